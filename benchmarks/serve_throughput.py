"""The server against generate() on the same rows, in the same process (issue 31), 3B shape.

Workload (benchmarks/grpo_shaped.py's, generated from seeds, no downloads): the random-weight
Qwen2.5-VL-3B-shaped checkpoint (bf16), 64 GRPO-shaped prompts (images of 112-448 px, text rows;
videos are not served yet, so the video rows of grpo_shaped's mix become images) x 8 samples =
512 rows, T=1 sampling, cap 256 new tokens, a seeded random stop set of vocab/80 token ids
(random weights never emit EOS; mean response ~80 tokens).

Parts:
- generate:  MegatronGeneration.generate on the 512 rows (a warm-up call, then one timed call).
- burst:     the same 512 rows as 512 concurrent single-turn requests (n=1; --n 8 sends 64
             requests of n=8 instead) through the OpenAI-compatible server in this process,
             sent by load-generating clients in --clients child processes (8; their own
             interpreters: the clients' work does not share this process's GIL, and one httpx
             loop over 512 connections was itself seconds slow). Useful tokens/s = generated
             tokens / wall clock from the first request sent to the last answer read; the ratio to
             generate()'s is the issue's target (>= 0.85).
- arrivals:  --arrivals requests arriving at random (Poisson, --rate requests/s; 0: 0.9x the
             burst's request rate): mean batch occupancy (rows per decode step while requests
             were in flight, against the server's max_rows), p50/p99 latency.

    # one H200 (the same environment as benchmarks/grpo_shaped.py)
    python3 benchmarks/serve_throughput.py --out $OUT
    # CPU smoke test (tiny model, fp32, 4 prompts x 2 samples, cap 16, 8 random arrivals)
    uv run python benchmarks/serve_throughput.py --tiny --out /tmp/serve-throughput
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = "serve_throughput_results.json"
# grpo_shaped's cycle without video rows (the server takes images and text).
KIND_CYCLE = [("image", 112), ("text", 0), ("image", 224), ("image", 336), ("image", 448),
              ("text", 0), ("image", 112), ("image", 224), ("image", 336), ("image", 448)]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    parser.add_argument("--tiny", action="store_true", help="tiny model, fp32: CPU smoke test")
    parser.add_argument("--prompts", type=int, default=None, help="unique prompts (64; tiny 4)")
    parser.add_argument("--samples", type=int, default=None, help="rows per prompt (8; tiny 2)")
    parser.add_argument("--n", type=int, default=1, help="choices per request (1 or --samples)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="cap (256; tiny 16)")
    parser.add_argument("--stop-every", type=int, default=80, help="stop set = vocab / this")
    parser.add_argument("--arrivals", type=int, default=None, help="random arrivals (512; 8)")
    parser.add_argument("--rate", type=float, default=0.0, help="arrivals/s (0: from burst)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", action="store_true",
        help="also report where the server's time goes: the engine thread's phases, request "
        "parsing/encoding (summed over requests), and one thread's cost to read the workload",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint", type=Path, default=Path("/tmp/rlflow-bench/qwen25vl-3b"),
        help="where the random checkpoint is written once (grpo_shaped's default folder)",
    )  # fmt: skip
    parser.add_argument(
        "--no-step-graphs", action="store_true",
        help="the server decodes through CUDA graphs of the decode alone (sampling eager)",
    )  # fmt: skip
    parser.add_argument(
        "--switch-interval", type=float, default=0.0,
        help="the GIL switch interval while the server runs (0: the engine's SWITCH_INTERVAL_S)",
    )  # fmt: skip
    parser.add_argument(
        "--no-generate", action="store_true",
        help="skip generate() (no ratio): the server's parts only, e.g. to study the request "
        "path on a CPU",
    )  # fmt: skip
    parser.add_argument(
        "--context-tokens", type=int, default=0,
        help="the server's context (0: 2048 + the cap); a CPU's exact decode attends over every "
        "row's whole context, so a CPU run of many rows wants it short",
    )  # fmt: skip
    parser.add_argument(
        "--clients", type=int, default=8,
        help="client processes the requests are spread over (1: one, as before 2026-12-05)",
    )  # fmt: skip
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.prompts = args.prompts or (4 if tiny else 64)
    args.samples = args.samples or (2 if tiny else 8)
    args.max_new_tokens = args.max_new_tokens or (16 if tiny else 256)
    args.arrivals = args.arrivals or (8 if tiny else 512)
    if tiny and args.checkpoint == parser.get_default("checkpoint"):
        args.checkpoint = Path("/tmp/rlflow-bench/tiny")
    return args


# ----------------------------------------------------------------------------- the client


def client_main(spec_path: str) -> None:
    """A child process: send the spec's requests (a burst, or at its arrival times) once the
    parent says go, print each one's latency and generated tokens as JSON."""
    import httpx

    spec = json.loads(Path(spec_path).read_text())

    async def run():
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
        async with httpx.AsyncClient(base_url=spec["url"], limits=limits, timeout=3600) as http:
            print("ready", flush=True)
            sys.stdin.readline()  # every client starts at once
            start = time.perf_counter()

            async def one(body, at):
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
                sent = time.perf_counter()
                response = await http.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                usage = response.json()["usage"]
                return time.perf_counter() - sent, usage["completion_tokens"], sent

            results = await asyncio.gather(
                *(one(spec["messages"][m] | spec["fields"][i], at)
                  for i, (m, at) in zip(spec["index"], zip(spec["which"], spec["at"])))
            )  # fmt: skip
            return start, results

    start, results = asyncio.run(run())
    # times: time.perf_counter() (CLOCK_MONOTONIC: the server's request times compare)
    print(json.dumps({"start": start, "latency_s": [r[0] for r in results],
                      "tokens": [r[1] for r in results], "sent_at": [r[2] for r in results]}))  # fmt: skip


def send(url: str, messages, which, fields, at, out: Path, clients: int) -> dict:
    """The requests from `clients` child processes (request i from client i % clients), all
    started at once: one client process's event loop (httpx's pool over hundreds of
    connections) paces a burst by itself. -> wall_s (the first client's start to the last
    answer read), each request's latency_s, tokens and sent_at, in request order."""
    procs = []
    for k in range(clients):
        index = list(range(k, len(which), clients))
        spec = out / f"client_spec_{k}.json"
        spec.write_text(json.dumps(
            {"url": url, "messages": messages, "which": [which[i] for i in index],
             "fields": fields, "at": [at[i] for i in index], "index": index}
        ))  # fmt: skip
        procs.append((index, subprocess.Popen(
            [sys.executable, __file__, "--out", str(out), "--client", str(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )))  # fmt: skip
    for _, proc in procs:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a client failed:\n{proc.communicate()[1][-4000:]}")
    for _, proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    merged = {key: [None] * len(which) for key in ("latency_s", "tokens", "sent_at")}
    starts, ends = [], []
    for index, proc in procs:
        stdout, stderr = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"a client failed:\n{stderr[-4000:]}")
        result = json.loads(stdout)
        starts.append(result["start"])
        for key in merged:
            for i, value in zip(index, result[key]):
                merged[key][i] = value
        ends += [s + lat for s, lat in zip(result["sent_at"], result["latency_s"])]
    return {"wall_s": max(ends) - min(starts), **merged}


# ----------------------------------------------------------------------------- the workload


def as_messages(sample, suffix: str) -> dict:
    """The sample's conversation, images as PNG data URLs (what a client sends)."""
    content = []
    for image in sample.images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        content.append({"type": "image_url", "image_url": {"url": url}})
    content.append({"type": "text", "text": sample.question + suffix})
    return {"model": "bench", "messages": [{"role": "user", "content": content}]}


def main() -> None:
    args = parse_args()
    if args.client:
        client_main(args.client)
        return

    from benchmarks.grpo_shaped import bench_checkpoint, make_samples, stop_token_ids
    from rlflow import parallel
    from rlflow.compat import library_logs
    from rlflow.generation.base import SamplingParams
    from rlflow.model.build import load_policy
    from rlflow.model.processor import PromptEncoder
    from rlflow.rules import load_checked
    from rlflow.serve.runner import ServerThread, served_engine

    library_logs.quiet()
    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f} s] {message}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    base = load_checked(ROOT / "recipes" / "base.yaml").recipe
    info = parallel.init_parallel(
        base.parallelism, args.seed, timeout_s=base.watchdog.collective_timeout_s, placement=None
    )
    device = info.device
    checkpoint = bench_checkpoint(args.checkpoint, args.tiny, device, True)
    rows = args.prompts * args.samples
    recipe = load_checked(ROOT / "recipes" / "base.yaml", [
        f"model.checkpoint={checkpoint}", f"model.dtype={'float32' if args.tiny else 'bfloat16'}",
        f"generation.max_new_tokens={args.max_new_tokens}", "data.max_prompt_tokens=2048",
        f"generation.server.max_rows={rows}", "generation.server.context_tokens="
        f"{args.context_tokens or 2048 + args.max_new_tokens}",
        "generation.server.max_connections=4096",
        "generation.release_cache=false",
    ]).recipe  # fmt: skip
    policy = load_policy(checkpoint, recipe.model, base.parallelism, trainable=False)
    encoder = PromptEncoder(checkpoint, recipe.data)
    samples = make_samples(args.prompts, args.seed, encoder.tokenizer, KIND_CYCLE)
    unique = [encoder.encode(s) for s in samples]
    prompts = [p for p in unique for _ in range(args.samples)]
    vocab = policy.hf_config.get_text_config().vocab_size
    stops = stop_token_ids(vocab, args.stop_every, args.seed)
    params = SamplingParams(args.max_new_tokens, 1.0, 1.0, 0, args.seed, stops, False)
    results: dict = {"argv": sys.argv[1:], "device": str(device), "rows": rows,
                     "workload": {"prompts": args.prompts, "samples": args.samples, "n": args.n,
                                  "max_new_tokens": args.max_new_tokens}}  # fmt: skip
    gen = recipe.generation

    # 1. generate(): the trainer's call on the same rows
    if not args.no_generate:
        _generate(results, policy, encoder, gen, prompts, params, device, log)

    # 2. the server: a burst of every row at once
    if args.no_step_graphs:
        from rlflow.serve.batch import RunningBatch

        RunningBatch.step_graphs = False
    if args.switch_interval:
        import rlflow.serve.engine

        rlflow.serve.engine.SWITCH_INTERVAL_S = args.switch_interval
    served = served_engine(policy, checkpoint, recipe, "bench")
    server = ServerThread(served, "127.0.0.1", 0, 4096, 60).start()
    messages = [as_messages(s, recipe.data.prompt_suffix) for s in samples]
    n = args.n
    per_prompt = args.samples // n
    which = [p for p in range(args.prompts) for _ in range(per_prompt)]
    fields = [{"max_tokens": args.max_new_tokens, "temperature": 1.0, "n": n, "seed": i,
               "stop_token_ids": list(stops)} for i in range(len(which))]  # fmt: skip
    send(server.url, messages, which, fields, [0.0] * len(which), args.out, args.clients)  # warm-up
    if args.profile:
        results["ingest_one_thread"] = _ingest_cost(served, messages)
        log(f"reading the {len(messages)} unique requests in one thread: "
            f"{results['ingest_one_thread']}")  # fmt: skip
    stats = served.engine.stats
    steps, rows_run = stats.steps, stats.rows
    served.prompts.clear()  # the burst encodes its prompts again (the warm-up's are not kept)
    before, prefills = _seconds(served), stats.prefills
    if args.profile:
        served.trace = []  # each request's stage times (rlflow/serve/requests.py)
    burst = send(server.url, messages, which, fields, [0.0] * len(which), args.out, args.clients)
    burst_tokens = sum(burst["tokens"])
    rate = burst_tokens / burst["wall_s"]
    results["burst"] = {
        "requests": len(which), "wall_s": burst["wall_s"], "tokens": burst_tokens,
        "tokens_per_s": rate,
        "ratio_to_generate": rate / results["generate"]["tokens_per_s"] if "generate" in results
        else None,
        "mean_occupancy": (stats.rows - rows_run) / max(stats.steps - steps, 1),
        "p50_latency_s": _quantile(burst["latency_s"], 0.5),
        "p99_latency_s": _quantile(burst["latency_s"], 0.99),
    }  # fmt: skip
    ratio = results["burst"]["ratio_to_generate"]
    log(f"burst: {burst_tokens} tokens in {burst['wall_s']:.2f} s = {rate:,.0f} tok/s "
        f"({f'{ratio:.2f}' if ratio is not None else 'no'} of generate()), mean occupancy "
        f"{results['burst']['mean_occupancy']:.1f}")  # fmt: skip
    if args.profile:
        results["burst"]["seconds"] = _delta(before, _seconds(served), stats, steps, prefills)
        log(f"burst, where the time went: {results['burst']['seconds']}")
        results["burst"]["path"] = _path_report(served.trace, burst)
        results["burst"]["trace"] = served.trace  # each request's stage times (raw)
        log("burst, the request path:\n" + _path_table(results["burst"]["path"]))

    # 3. random arrivals (Poisson) at a rate that keeps the batch busy
    requests_per_s = args.rate or 0.9 * len(which) / burst["wall_s"]
    rng = random.Random(args.seed)
    at, clock = [], 0.0
    for _ in range(args.arrivals):
        clock += rng.expovariate(requests_per_s)
        at.append(clock)
    pick = [rng.randrange(args.prompts) for _ in at]
    fields = [{"max_tokens": args.max_new_tokens, "temperature": 1.0, "n": 1, "seed": 10**6 + i,
               "stop_token_ids": list(stops)} for i in range(len(at))]  # fmt: skip
    steps, rows_run = stats.steps, stats.rows
    served.prompts.clear()
    before, prefills = _seconds(served), stats.prefills
    if args.profile:
        served.trace = []
    arrivals = send(server.url, messages, pick, fields, at, args.out, args.clients)
    occupancy = (stats.rows - rows_run) / max(stats.steps - steps, 1)
    results["arrivals"] = {
        "requests": len(at), "rate_per_s": requests_per_s, "wall_s": arrivals["wall_s"],
        "tokens_per_s": sum(arrivals["tokens"]) / arrivals["wall_s"],
        "mean_occupancy": occupancy, "max_rows": rows,
        "p50_latency_s": _quantile(arrivals["latency_s"], 0.5),
        "p99_latency_s": _quantile(arrivals["latency_s"], 0.99),
    }  # fmt: skip
    log(f"arrivals: {len(at)} at {requests_per_s:.1f}/s: mean occupancy {occupancy:.1f} rows, "
        f"p50 {results['arrivals']['p50_latency_s']:.2f} s, "
        f"p99 {results['arrivals']['p99_latency_s']:.2f} s")  # fmt: skip
    if args.profile:
        results["arrivals"]["seconds"] = _delta(before, _seconds(served), stats, steps, prefills)
        log(f"arrivals, where the time went: {results['arrivals']['seconds']}")
        results["arrivals"]["path"] = _path_report(served.trace, arrivals)
        results["arrivals"]["trace"] = served.trace  # each request's stage times (raw)
        log("arrivals, the request path:\n" + _path_table(results["arrivals"]["path"]))
    server.stop()
    (args.out / RESULTS).write_text(json.dumps(results, indent=2))
    log(f"wrote {args.out / RESULTS}")


def _generate(results, policy, encoder, gen, prompts, params, device, log) -> None:
    import torch

    from rlflow.generation.megatron.engine import MegatronGeneration

    engine = MegatronGeneration(
        policy, encoder.pad_token_id, max_batch_size=0, cuda_graphs=gen.cuda_graphs,
        compile_decode=gen.compile_decode, share_prompts=True, fp8=False, release_cache=False,
        cache_tokens=gen.kv_cache_tokens,
    )  # fmt: skip
    engine.generate(prompts, params)  # warm-up: graphs, compiled code
    _sync(torch, device)
    t0 = time.perf_counter()
    done = engine.generate(prompts, params)
    _sync(torch, device)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in done)
    results["generate"] = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}
    log(f"generate(): {tokens} tokens in {wall:.2f} s = {tokens / wall:,.0f} tok/s")
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _seconds(served) -> dict[str, float]:
    """The engine thread's phase seconds (with "idle": waiting for any work, up to now) and
    the request-reading seconds, so far."""
    seconds = {**served.engine.stats.seconds, **served.seconds}
    since = served.engine.idle_since
    if since is not None:
        seconds["idle"] = seconds.get("idle", 0.0) + time.perf_counter() - since
    return seconds


def _delta(before: dict, after: dict, stats, steps: int, prefills: int) -> dict:
    out = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
    out["decode_steps"] = stats.steps - steps
    out["prefills"] = stats.prefills - prefills
    return out


def _ingest_cost(served, messages: list[dict]) -> dict:
    """Seconds one thread takes to read the unique requests: JSON, parse (image decode),
    encode (chat template, processor)."""
    from rlflow.serve.chat import parse_chat

    bodies = [json.dumps(m) for m in messages]
    t0 = time.perf_counter()
    parsed = [json.loads(b) for b in bodies]
    t1 = time.perf_counter()
    chats = [parse_chat(b, "bench") for b in parsed]
    t2 = time.perf_counter()
    for chat in chats:
        served.encoder.encode(chat)
    t3 = time.perf_counter()
    return {"requests": len(bodies), "json_s": round(t1 - t0, 3), "parse_s": round(t2 - t1, 3),
            "encode_s": round(t3 - t2, 3), "mb": round(sum(map(len, bodies)) / 1e6, 1)}  # fmt: skip


# A request's stages in order (rlflow/serve/requests.py, Request.times): the handler starts
# (headers read), its body is received and read as JSON, checked (parse_chat), picked up by the
# encoding thread, encoded, back on the event loop and queued for the engine, admitted into a
# prefill, its first check with a token, done, answered (the response body built).
STAGES = ("start", "arrived", "parsed", "encoding", "encoded", "submitted", "admitted",
          "first_token", "done", "answered")  # fmt: skip


def _path_report(trace: list[dict], client: dict) -> dict:
    """Per-request stage times -> each gap's p50/p99/max (ms) and each stage's time since the
    client's first send (p50/p99/last, s; "received": the client has read the answer): where
    requests wait before the engine has them, and after."""
    sent_at = client["sent_at"]
    first = min(sent_at)
    out: dict = {"requests": len(trace), "gaps_ms": {}, "since_first_send_s": {
        "sent": _spread([t - first for t in sent_at], 1.0)}}  # fmt: skip
    for a, b in zip(STAGES, STAGES[1:]):
        out["gaps_ms"][f"{a}->{b}"] = _spread([t[b] - t[a] for t in trace if a in t and b in t],
                                              1e3)  # fmt: skip
    for stage in STAGES:
        out["since_first_send_s"][stage] = _spread([t[stage] - first for t in trace
                                                    if stage in t], 1.0)  # fmt: skip
    out["since_first_send_s"]["received"] = _spread(
        [s + lat - first for s, lat in zip(sent_at, client["latency_s"])], 1.0
    )
    arrived = [t["arrived"] for t in trace if "arrived" in t]
    admitted = [t["admitted"] for t in trace if "admitted" in t]
    if arrived and admitted:
        out["first_arrival_to_last_admission_s"] = round(max(admitted) - min(arrived), 4)
    return out


def _spread(values: list[float], scale: float) -> dict:
    if not values:
        return {}
    return {"p50": round(_quantile(values, 0.5) * scale, 4),
            "p99": round(_quantile(values, 0.99) * scale, 4),
            "max": round(max(values) * scale, 4)}  # fmt: skip


def _path_table(path: dict) -> str:
    lines = [f"  {'gap':<24} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}"]
    for name, v in path["gaps_ms"].items():
        if v:
            lines.append(f"  {name:<24} {v['p50']:9.2f} {v['p99']:9.2f} {v['max']:9.2f}")
    lines.append(f"  {'since the first send':<24} {'p50 s':>9} {'p99 s':>9} {'last s':>9}")
    for name, v in path["since_first_send_s"].items():
        if v:
            lines.append(f"  {name:<24} {v['p50']:9.3f} {v['p99']:9.3f} {v['max']:9.3f}")
    if "first_arrival_to_last_admission_s" in path:
        lines.append(f"  first arrival -> last admission: "
                     f"{path['first_arrival_to_last_admission_s']:.3f} s")  # fmt: skip
    return "\n".join(lines)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
