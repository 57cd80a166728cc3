"""Who handles the time-limit warning on a GPU rank, and does the real trainer act on it?

Two parts, one JSON summary (exit 0 only if every check passed):

--probe   One process on one GPU: rlflow's handlers for SIGUSR1, SIGHUP and SIGTERM, then CUDA
          init, an NCCL process group, torch.compile, a CUDA graph capture, a fresh Triton
          kernel and a Triton compile for sm_90 (the last also runs without a GPU). After each, which library handles each signal at the C level (sigaction +
          dladdr, rlflow/train/sigstate.py) and how many threads block it. Then each signal is
          sent to the process: was Python's handler run?

--train SIG (repeatable)  The real trainer, `rlflow train <recipe> --nproc N`, short: at step
          --at-step the warning is sent (and again every 2 s, as a re-sent warning would). With
          --nproc 1 the rank is the process `rlflow train` runs in and gets SIG itself; with
          --nproc 2+ SIG goes to the node launcher, as Slurm's USR1 does (it passes it on as
          slurm.stop_signal). Expected: "stopping at step K", a checkpoint step_K, exit 75; with
          --resume a second run resumes from it and finishes (exit 0, every step logged once).
          RLFLOW_SIGNAL_TRACE records the handlers at every phase change of every rank.

Cold caches per case (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR): a warm Triton cache skips
the compile that installs LLVM's handlers. Cases run at the same time (the tiny model shares
the GPU). The lead's 2-GPU run:

    PYTHONPATH=. python benchmarks/signal_gpu.py --out OUT --train USR1 --nproc 2 --resume

Used for benchmarks/signal_gpu.md:

    PYTHONPATH=. python benchmarks/signal_gpu.py --out OUT --probe --train HUP --train USR1 --resume
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = "recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml"
SHORT = [  # the recipe as it is, only shorter
    "warm_start.num_steps=4",
    "grpo.max_num_steps=8",
    "grpo.val_at_start=false",
    "grpo.val_period=0",
    "checkpointing.save_period=1000",
    "logging.progress_bar=false",
]
SIGNALS = (signal.SIGUSR1, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR2)


# --- the probe: one process ---------------------------------------------------------------------


def probe() -> dict:
    from rlflow.train import sigstate

    heard: list[str] = []
    for sig in (signal.SIGUSR1, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: heard.append(signal.Signals(s).name))
    phases = [{"phase": "rlflow handlers installed", "signals": sigstate.snapshot(SIGNALS)}]

    def after(name, work):
        start = time.perf_counter()
        try:
            work()
            error = None
        except Exception as exc:  # the probe reports, never stops
            error = f"{type(exc).__name__}: {exc}"
        phases.append(
            {
                "phase": name,
                "seconds": round(time.perf_counter() - start, 2),
                "error": error,
                "signals": sigstate.snapshot(SIGNALS),
            }
        )

    import torch

    x = {}
    after("cuda init", lambda: x.update(t=torch.ones(1 << 20, device="cuda")))
    after("nccl process group", _nccl_group)
    after("torch.compile (inductor, Triton)", lambda: _compiled(x["t"]))
    after("cuda graph capture + replay", lambda: _graph(x["t"]))
    after("a fresh Triton kernel", lambda: _triton_kernel(x["t"]))
    after("triton.compile for sm_90 (no GPU needed)", _triton_compile_only)
    deliveries = []
    for sig in (signal.SIGUSR1, signal.SIGHUP, signal.SIGUSR1, signal.SIGTERM):
        before = sigstate.owner(sig)
        count = len(heard)
        os.kill(os.getpid(), sig)
        deadline = time.monotonic() + 1.0
        while len(heard) == count and time.monotonic() < deadline:
            time.sleep(0.01)
        deliveries.append(
            {"signal": sig.name, "handler_before": before, "python_handler_ran": len(heard) > count}
        )
    return {"phases": phases, "deliveries": deliveries}


def _nccl_group() -> None:
    import torch
    import torch.distributed as dist

    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group(
            "nccl",
            init_method=f"file://{f.name}",
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", 0),
        )
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.destroy_process_group()


def _compiled(t) -> None:
    import torch

    fn = torch.compile(lambda a: torch.nn.functional.gelu(a) * 2 + a.sin())
    fn(t)
    torch.cuda.synchronize()


def _graph(t) -> None:
    import torch

    static = t.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        static.mul_(1.0001)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        static.mul_(1.0001)
    graph.replay()
    torch.cuda.synchronize()


def _triton_kernel(t) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def twice(src, dst, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n) * 2, mask=i < n)

    out = t.clone()
    twice[(triton.cdiv(t.numel(), 1024),)](t, out, t.numel(), BLOCK=1024)


def _triton_compile_only() -> None:
    """The same compile without a GPU (so the probe shows the takeover on a CPU machine too)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def thrice(src, dst, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i) * 3)

    signature = {"src": "*fp32", "dst": "*fp32"}
    source = ASTSource(fn=thrice, signature=signature, constexprs={"BLOCK": 64})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))


# --- the real trainer ---------------------------------------------------------------------------


def newest_beats(run_dir: Path) -> list[Path]:
    """The heartbeats of `rlflow train --nproc`'s newest attempt (status/attempt-<A>/)."""
    from rlflow.job import files

    attempts = files.attempt_dirs(run_dir)
    return sorted((attempts[-1] / files.HEARTBEAT).glob("rank-*.json")) if attempts else []


def heartbeat_steps(run_dir: Path, nproc: int) -> list[int]:
    paths = [run_dir / "heartbeat.json"] if nproc == 1 else newest_beats(run_dir)
    steps = []
    for path in paths:
        try:
            steps.append(int(json.loads(path.read_text()).get("step", 0)))
        except (OSError, ValueError):
            pass
    return steps if len(steps) == nproc else []


def run_trainer(run_dir: Path, args, env: dict, send: str | None, out: Path) -> dict:
    command = [sys.executable, "-m", "rlflow.cli", "train", args.recipe, *SHORT]
    command += ["--run-dir", str(run_dir)] + (
        ["--nproc", str(args.nproc)] if args.nproc > 1 else []
    )
    log = out / f"{run_dir.name}-{'stop' if send else 'resume'}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        sent_at = steps = None
        last = 0.0
        while proc.poll() is None:
            if time.monotonic() - started > args.case_timeout:
                proc.kill()
                break
            if send and sent_at is None:
                steps = heartbeat_steps(run_dir, args.nproc)
                if steps and min(steps) >= args.at_step:
                    sent_at = last = time.monotonic()
                    proc.send_signal(signal.Signals[f"SIG{send}"])
            elif send and time.monotonic() - last >= 2.0:
                proc.send_signal(signal.Signals[f"SIG{send}"])  # must change nothing
                last = time.monotonic()
            time.sleep(0.05)
        proc.wait()
    text = log.read_text(errors="replace")
    keys = ("rlflow", "stopping at step", "resumed from", "Error", "error:")
    lines = [line for line in text.splitlines() if any(key in line for key in keys)]
    return {
        "command": " ".join(command),
        "exit_code": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "signal_sent_at_steps": steps,
        "seconds_signal_to_exit": round(time.monotonic() - sent_at, 1) if sent_at else None,
        "rlflow_lines": lines[-12:],
        "log": log.name,
    }


def train_case(sig: str, args, out: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="signal-gpu-")) / f"train-{sig}-nproc{args.nproc}"
    run_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_"))}
    env.update(
        PYTHONUNBUFFERED="1",
        RLFLOW_SIGNAL_TRACE=str(run_dir / "signal-trace.jsonl"),
        TRITON_CACHE_DIR=str(run_dir / "triton-cache"),  # cold: see the module docstring
        TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor-cache"),
    )
    if args.nproc == 1:  # no launcher: the rank reports its progress here
        env["RLFLOW_HEARTBEAT_FILE"] = str(run_dir / "heartbeat.json")
    result = {"signal_sent": sig, "nproc": args.nproc}
    stop = run_trainer(run_dir, args, env, sig, out)
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    said = [line for line in stop["rlflow_lines"] if "stopping at step" in line]
    result.update(stop=stop, checkpoints=saved)
    result["trace"] = summarise_trace(run_dir / "signal-trace.jsonl")
    ok = stop["exit_code"] == 75 and bool(saved) and bool(said)
    if ok and args.resume:
        resume = run_trainer(run_dir, args, env, None, out)
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
        resumed = any("resumed from" in line for line in resume["rlflow_lines"])
        result.update(resume=resume, metrics_steps=steps)
        ok = resume["exit_code"] == 0 and resumed and steps == sorted(set(steps))
    result["ok"] = ok
    trace = run_dir / "signal-trace.jsonl"
    if trace.exists():
        (out / f"{run_dir.name}-trace.jsonl").write_bytes(trace.read_bytes())
    return result


def summarise_trace(path: Path) -> list[dict]:
    """Each change of a signal's handler, and the phase it was first seen in."""
    changes, last = [], {}
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
    for record in records:
        for name, state in record["signals"].items():
            key = (record.get("rank"), name)
            if last.get(key) != state["owner"]:
                changes.append(
                    {
                        "rank": record.get("rank"),
                        "signal": name,
                        "owner": state["owner"],
                        "threads": state.get("threads"),
                        "threads_blocking": state.get("blocking"),
                        "seen_at_phase": record["phase"],
                        "after_phase": record["after"],
                        "step": record["step"],
                    }
                )
                last[key] = state["owner"]
    return changes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--train", action="append", default=[], choices=["USR1", "HUP", "TERM"])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--at-step", type=int, default=3)
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--case-timeout", type=float, default=240.0)
    parser.add_argument("--probe-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe_child:  # os._exit: an NCCL or compile-pool teardown must not hold the run
        print(json.dumps(probe()), flush=True)
        os._exit(0)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}

    def record(name: str, result: dict) -> None:  # written as each part ends: a run cut short
        results[name] = result  # by its time limit still leaves what finished
        (args.out / "summary.json").write_text(json.dumps(results, indent=2))

    threads = [
        threading.Thread(target=lambda s=s: record(s, train_case(s, args, args.out)))
        for s in args.train
    ]
    for thread in threads:
        thread.start()
    if args.probe:  # a child of its own: its handlers and threads are the process's only ones
        cache = Path(tempfile.mkdtemp(prefix="signal-gpu-probe-"))
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache / "triton")}
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        try:
            child = subprocess.run(
                [sys.executable, __file__, "--out", str(args.out), "--probe-child"],
                capture_output=True,
                text=True,
                env=env,
                cwd=ROOT,
                timeout=args.case_timeout,
            )
            record("probe", json.loads(child.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError, subprocess.TimeoutExpired) as exc:
            record("probe", {"error": f"{type(exc).__name__}: {exc}"})
    for thread in threads:
        thread.join()
    import torch

    summary = {
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        **results,
        "ok": all(results[s]["ok"] for s in args.train),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary)[-6000:])
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
