"""A 3-turn, tool-using GRPO step on the Qwen2.5-VL-3B shape, split into generation,
environment and training, against the same batch as one-turn rollouts in the same process
(issue 32's GPU benchmark; results: benchmarks/multiturn_step_gpu.md).

Workload (seeded, no downloads), on grpo_shaped.py's random-weight 3B checkpoint
(`rlflow init-tiny-model --preset qwen25vl-3b`, its processor's pixel limit raised to 448 px),
bf16, through the 3B recipe's trainer (rlflow.train.setup + loop.grpo_step, as grpo_shaped.py's
`step` part):
- grpo_shaped.py's 64 mixed-media prompts (images of 112-448 px, 4-frame videos, text rows;
  ragged questions) x 8 trajectories = 512;
- each model turn: T=1, cap --max-new-tokens (256), and the seeded stop set of vocab/80 ids
  that grpo_shaped.py uses (random weights never emit EOS; mean ~75 tokens a turn);
- **multi-turn**: `ForcedToolTurns`, a benchmark-only environment written to rlflow's
  environment interface (rlflow.environment.base.Environment + Trajectory, as tool_scenes):
  every model turn but the last counts as a tool call, whatever it says (a random-weight model
  writes no valid call), and the tool's result (--tool-words seeded words, through
  `Trajectory.call_tool`) comes back as a `tool` message that the chat template renders:
  environment tokens, in the context, loss mask 0. So every trajectory takes exactly --turns
  (3) model turns, each generated for the whole batch in one engine call. The trainer uses it
  through `rlflow.environment.factory.environment_override` (no recipe kind: benchmark only);
- **one-turn reference**: the same prompts, caps and stop set through the recipe's own
  `single_turn` environment, in the same process, steps interleaved with the multi-turn ones.

Per step: generation s (the engine's generate calls, synchronised), environment s (the rest of
the trainer's generation phase: tool calls, rendering the template and tokenizing the tool
turns, building the trajectories), rewards s, training s (the logprob pass + the update),
whole step s (wall clock around loop.grpo_step, synchronised), tokens/s/GPU counted two ways
(model-generated tokens; every token of the trained rows: prompt + model + environment tokens,
the trainer's train/real_tokens), and turns per trajectory. Step 1 of each kind includes
CUDA-graph capture and compilation: the summary is the median of each kind's later steps.

    # one H200 (wheels as in generation_throughput.md; PYTHONPATH=/tmp/site:$PWD): ~5-6 min
    # including writing the 3B checkpoint; JSON under --out, a summary at the end
    python3 benchmarks/multiturn_step_gpu.py --out $OUT/mt
    # CPU smoke test (tiny model, fp32, 4 prompts x 2, cap 16, one step of each kind)
    uv run python benchmarks/multiturn_step_gpu.py --tiny --out /tmp/mt-step
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpo_shaped as gs  # noqa: E402  (the checkpoint, workload, stop set and sampling hook)

from rlflow.environment.base import Environment, EnvRollouts, turn_params  # noqa: E402
from rlflow.environment.trajectory import Trajectory  # noqa: E402

RESULTS = "multiturn_step_gpu.json"


# ----------------------------------------------------------------------------- environment


@dataclasses.dataclass
class EnvClock:
    """One rollout's time inside the environment, by what it did (seconds)."""

    rollout_s: float = 0.0  # the whole rollout call
    generate_s: float = 0.0  # inside backend.generate (the engine, synchronised)
    tool_s: float = 0.0  # Trajectory.call_tool: the tool in its thread
    render_s: float = 0.0  # Trajectory.add_environment_turn: template + tokenize + continuity
    tool_calls: int = 0
    scrubbed_tokens: int = 0  # media placeholder ids replaced (see ForcedToolTurns._scrub)


class ForcedToolTurns(Environment):
    """Benchmark-only: every model turn but the last is answered by a tool, whatever the policy
    wrote; the last turn ends the trajectory. The tool's answer is --tool-words seeded words (a
    search result, say), rendered by the chat template as a `tool` message (in Qwen's
    templates, `<tool_response>` in a user turn): context only, loss mask 0.

    A turn that stops on the benchmark's stop set ends as the policy's EOS would: its text
    records the template's end-of-turn, its ids keep the sampled stop token (same length), so
    the template's continuity check (Trajectory.add_environment_turn) holds. A random-weight
    model samples the image/video placeholder ids now and then (together ~1 in 76,000 tokens
    on the 3B's vocabulary); in a later turn's prompt that would be a placeholder without media,
    which the engine refuses. Those ids in turns that a later turn continues are replaced by an
    ordinary token (`filler_id`), counted in `scrubbed_tokens`: their logprob is then not the
    token's (about one token a step on the 3B)."""

    def __init__(self, encoder, *, turns: int, tool_words: tuple[int, int], timeout_s: float,
                 seed: int, media_ids: set[int], filler_id: int):  # fmt: skip
        from rlflow.data.prompts import to_messages

        self.encoder = encoder
        self.turns, self.tool_words, self.timeout_s, self.seed = turns, tool_words, timeout_s, seed
        self.media_ids, self.filler_id = media_ids, filler_id
        self.to_messages = to_messages
        tokenizer = encoder.tokenizer
        self.stop_text = tokenizer.decode([encoder.eos_token_id], skip_special_tokens=False)
        self.clocks: list[EnvClock] = []  # one per rollout call, read by the benchmark

    def _messages(self, sample) -> list[dict]:
        suffix = self.encoder.data_cfg.prompt_suffix
        if self.encoder.multimodal:
            return self.to_messages(sample, suffix)
        return [{"role": "user", "content": sample.question + suffix}]

    def tool(self, row: int, turn: int) -> str:
        """The tool's answer to trajectory `row`'s call in `turn`: seeded words."""
        rng = random.Random(self.seed * 1_000_003 + row * 64 + turn)
        words = rng.randint(*self.tool_words)
        return "results: " + " ".join(rng.choice(gs.WORDS) for _ in range(words))

    def _scrub(self, completion, clock: EnvClock):
        if not self.media_ids.intersection(completion.token_ids):
            return completion
        ids = [self.filler_id if t in self.media_ids else t for t in completion.token_ids]
        clock.scrubbed_tokens += sum(a != b for a, b in zip(ids, completion.token_ids))
        return dataclasses.replace(completion, token_ids=ids)

    def rollout(self, backend, prompts, samples, params) -> EnvRollouts:
        clock = EnvClock()
        start = time.perf_counter()
        decode = self.encoder.tokenizer.decode
        trajectories = [
            Trajectory(p, self._messages(s), p.text) for p, s in zip(prompts, samples, strict=True)
        ]
        finals = [""] * len(trajectories)
        for turn in range(self.turns):
            active = [i for i, tr in enumerate(trajectories) if not tr.done]
            began = time.perf_counter()
            outs = backend.generate(
                [trajectories[i].turn_prompt() for i in active], turn_params(params, turn)
            )
            clock.generate_s += time.perf_counter() - began
            last = turn == self.turns - 1
            for i, completion in zip(active, outs, strict=True):
                tr = trajectories[i]
                if not last:
                    completion = self._scrub(completion, clock)
                ids = completion.token_ids
                stopped = completion.finish_reason == "stop" and bool(ids)
                content = decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
                end = self.stop_text if stopped else ""
                tr.add_model_turn(completion, content, end, backend.weight_version)
                if last:
                    finals[i] = decode(ids)
                    tr.done = True
                    continue
                began = time.perf_counter()
                answer = tr.call_tool(self.tool, (i, turn), self.timeout_s, _is_text)
                clock.tool_s += time.perf_counter() - began
                clock.tool_calls += 1
                if answer is None:  # the task failed (it cannot here: counted all the same)
                    continue
                began = time.perf_counter()
                tr.add_environment_turn(
                    {"role": "tool", "content": answer},
                    self.encoder.processor,
                    self.encoder.tokenizer,
                )
                clock.render_s += time.perf_counter() - began
        failed = {i: tr.failure for i, tr in enumerate(trajectories) if tr.failure}
        sums = {
            "env/trajectories": float(len(trajectories)),
            "env/turns": float(sum(tr.model_turns for tr in trajectories)),
            "env/tool_calls": float(clock.tool_calls),
            "env/valid_tool_calls": float(clock.tool_calls),
            "env/malformed_tool_calls": 0.0,
            "env/answered_without_tool": 0.0,
        }
        clock.rollout_s = time.perf_counter() - start
        self.clocks.append(clock)
        return EnvRollouts([tr.completion() for tr in trajectories], finals, sums, failed)

    def reference(self, sample, prompt):
        raise NotImplementedError("the benchmark runs no warm start (warm_start.num_steps: 0)")


def _is_text(answer) -> bool:
    return isinstance(answer, str)


# ----------------------------------------------------------------------------- steps


def step_row(kind, step, wall_s, metrics, calls, clock, gpus, counts, ceil) -> dict:
    """One step's figures (module docstring): its engine calls, the environment's clock (multi-
    turn) and the trainer's metrics."""
    generation_s = sum(c["seconds"] for c in calls)
    phase = {k.removeprefix("time/"): v for k, v in metrics.items() if k.startswith("time/")}
    environment_s = phase.get("generation", 0.0) - generation_s
    training_s = phase.get("logprobs", 0.0) + phase.get("training", 0.0)
    accounted = generation_s + environment_s + phase.get("reward", 0.0) + training_s
    accounted += phase.get("weight_refresh", 0.0)
    trajectories = calls[0]["rows"]
    model_tokens = sum(c["useful_tokens"] for c in calls)
    prompt_tokens = calls[0]["prompt_tokens"]  # turn 1's prompts: every trajectory's own prompt
    context_tokens = int(metrics["train/real_tokens"])
    rate = ceil["matmul_tflop_s"] * 1e12 * gpus
    update_flops = 6 * counts["lm_matmul_params"] * context_tokens
    row = {
        "kind": kind,
        "step": step,
        "wall_s": wall_s,
        "generation_s": generation_s,
        "environment_s": environment_s,
        "reward_s": phase.get("reward", 0.0),
        "training_s": training_s,
        "logprobs_s": phase.get("logprobs", 0.0),
        "update_s": phase.get("training", 0.0),
        "weight_refresh_s": phase.get("weight_refresh", 0.0),
        "other_s": wall_s - accounted,  # the batch, the metrics, what the phases leave out
        "trainer_time": phase,
        "trajectories": trajectories,
        "turns_per_trajectory": sum(c["rows"] for c in calls) / trajectories,
        "env_turns_per_trajectory": metrics.get("env/turns_per_trajectory"),
        "tool_calls_per_trajectory": metrics.get("env/tool_calls_per_trajectory", 0.0),
        "prompt_tokens": prompt_tokens,
        "model_tokens": model_tokens,
        "environment_tokens": context_tokens - prompt_tokens - model_tokens,
        # the trainer's loss-mask-1 tokens (train/response_length x rollouts): the model's only
        "trained_tokens": round(metrics["train/response_length"] * trajectories),
        "context_tokens": context_tokens,
        "environment_tokens_per_tool_call": (context_tokens - prompt_tokens - model_tokens)
        / max(trajectories * (len(calls) - 1), 1),
        "model_tokens_per_trajectory": model_tokens / trajectories,
        "context_tokens_per_trajectory": context_tokens / trajectories,
        "model_tokens_per_s_per_gpu": model_tokens / wall_s / gpus,
        "context_tokens_per_s_per_gpu": context_tokens / wall_s / gpus,
        "generation_tokens_per_s": model_tokens / max(generation_s, 1e-9),
        "update_mfu": update_flops / max(phase.get("training", 0.0), 1e-9) / rate,
        "turns": [
            {
                "rows": c["rows"],
                "seconds": c["seconds"],
                "prompt_tokens": c["prompt_tokens"],
                "unique_prompts": c["unique_prompts"],
                "model_tokens": c["useful_tokens"],
                "mean_response": c["mean_response"],
                "rows_at_cap": c["rows_at_cap"],
                "prefill_s": c["engine"].get("prefill_s"),
                "decode_ms_per_step": c["engine"].get("decode_ms_per_step"),
                "passes": c["engine"].get("passes"),
                "preempted": c["engine"].get("preempted"),
            }
            for c in calls
        ],
        "token_mult_prob_error": metrics.get("train/token_mult_prob_error"),
        "trainer_step_tokens_per_s_per_gpu": metrics.get("speed/step_tokens_per_s_per_gpu"),
        **{k: v for k, v in metrics.items() if k.startswith("memory/")},
    }
    if clock is not None:
        row["environment_parts"] = {
            "tool_s": clock.tool_s,
            "render_s": clock.render_s,
            # the rest of the rollout outside the engine: trajectories, decoding, bookkeeping
            "rest_s": clock.rollout_s - clock.generate_s - clock.tool_s - clock.render_s,
            "rollout_s": clock.rollout_s,
            "tool_calls": clock.tool_calls,
        }
        row["scrubbed_tokens"] = clock.scrubbed_tokens
    return row


SUMMARY_KEYS = (
    "wall_s", "generation_s", "environment_s", "reward_s", "training_s", "logprobs_s",
    "update_s", "weight_refresh_s", "other_s", "turns_per_trajectory", "model_tokens",
    "environment_tokens", "environment_tokens_per_tool_call", "context_tokens", "trained_tokens", "model_tokens_per_trajectory",
    "context_tokens_per_trajectory", "model_tokens_per_s_per_gpu",
    "context_tokens_per_s_per_gpu", "generation_tokens_per_s", "update_mfu",
)  # fmt: skip


RATIO_KEYS = ("wall_s", "generation_s", "training_s", "context_tokens", "model_tokens",
              "model_tokens_per_s_per_gpu", "context_tokens_per_s_per_gpu")  # fmt: skip


def summarise(rows: list[dict]) -> dict:
    """Medians of a kind's steps after its first (all of them when it ran one step)."""
    later = rows[1:] or rows
    out = {key: statistics.median(r[key] for r in later) for key in SUMMARY_KEYS}
    out["steps"] = [r["step"] for r in later]
    out["per_turn_seconds"] = [
        statistics.median(r["turns"][k]["seconds"] for r in later)
        for k in range(len(later[0]["turns"]))
    ]
    out["per_turn_prompt_tokens"] = [r["prompt_tokens"] for r in later[0]["turns"]]
    out["per_turn_mean_response"] = [r["mean_response"] for r in later[0]["turns"]]
    if "environment_parts" in later[0]:
        out["environment_parts"] = {
            k: statistics.median(r["environment_parts"][k] for r in later)
            for k in ("tool_s", "render_s", "rest_s")
        }
    out["peak_gib"] = [r.get("memory/peak_gib") for r in rows]
    return out


def run(args, log, results, save) -> None:
    from megatron.core import parallel_state

    from rlflow import parallel
    from rlflow.data import PromptSampler
    from rlflow.environment.factory import environment_override
    from rlflow.model.processor import PromptEncoder
    from rlflow.rules import load_checked
    from rlflow.train import loop
    from rlflow.train.setup import setup

    loaded = load_checked(args.recipe, overrides(args, args.checkpoint))
    info = parallel.init_parallel(
        loaded.recipe.parallelism,
        args.seed,
        timeout_s=loaded.recipe.watchdog.collective_timeout_s,
        placement=None,
    )
    device = info.device
    results["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    start = time.perf_counter()
    checkpoint = gs.bench_checkpoint(args.checkpoint, args.tiny, device, True)
    results["checkpoint_s"] = time.perf_counter() - start
    loaded = load_checked(args.recipe, overrides(args, checkpoint))
    counts = gs.model_counts(checkpoint, 4 if args.tiny else 2)
    results["model"] = counts
    results["ceilings"] = ceil = gs.ceilings(device)
    log(f"checkpoint {checkpoint} in {results['checkpoint_s']:.1f} s ({counts['total_params']:,}"
        f" params); ceilings {json.dumps(ceil)}")  # fmt: skip

    encoder = PromptEncoder(checkpoint, loaded.recipe.data)
    samples = gs.make_samples(args.prompts, args.seed, encoder.tokenizer)
    stop_ids = gs.stop_token_ids(counts["vocab_size"], args.stop_every, args.seed)
    lengths = [len(encoder.encode(s).token_ids) for s in samples]
    results["workload"].update(
        kinds={k: sum(s.kind == k for s in samples) for k in sorted({s.kind for s in samples})},
        stop_set_size=len(stop_ids),
        prompt_tokens_mean=statistics.mean(lengths),
        prompt_tokens_max=max(lengths),
    )
    log(f"workload {json.dumps(results['workload'])}")
    save()

    parallel_state.destroy_model_parallel()  # setup() initialises it again (same world)
    run_dir = Path(tempfile.mkdtemp(prefix="rlflow-bench-multiturn-"))
    try:
        start = time.perf_counter()
        t = setup(loaded, run_dir)
        # grpo_shaped.py's prompts replace the recipe's dataset: every step draws all of them
        t.train_data = samples
        t.sampler = PromptSampler(len(samples), len(samples), args.seed)
        t.context = dataclasses.replace(t.context, train_data=samples, sampler=t.sampler)
        t.rollouts.context = t.context
        sampling = gs.BenchmarkSampling(t.backend.generate, device, t.backend)
        sampling.stop_ids, sampling.max_new_tokens = stop_ids, args.max_new_tokens
        t.backend.generate = sampling
        loop._resume_or_start(t)  # what loop.train does first: optimizer, reference = policy
        results["trainer_build_s"] = time.perf_counter() - start
        log(f"trainer built in {results['trainer_build_s']:.1f} s")
        tokenizer = encoder.tokenizer
        env = ForcedToolTurns(
            t.encoder,
            turns=args.turns,
            tool_words=args.tool_words,
            timeout_s=loaded.recipe.environment.task_timeout_s,
            seed=args.seed,
            media_ids={counts["image_token_id"], counts["video_token_id"]},
            filler_id=tokenizer(" the", add_special_tokens=False)["input_ids"][-1],
        )
        # interleaved, multi-turn first: M S M S M ... (each kind's first step is its warm-up)
        order = []
        for k in range(max(args.steps, args.single_steps)):
            order += ["multi_turn"] * (k < args.steps) + ["single_turn"] * (k < args.single_steps)
        rows: dict[str, list] = {"multi_turn": [], "single_turn": []}
        results["steps"] = []
        for kind in order:
            step = t.step + 1
            calls_before, clocks_before = len(sampling.calls), len(env.clocks)
            multi = kind == "multi_turn"
            gs._sync(device)
            began = time.perf_counter()
            try:
                with environment_override(lambda recipe, enc: env) if multi else nullcontext():
                    metrics = loop.grpo_step(t, step)
            except Exception as err:  # noqa: BLE001 - keep what ran, say what failed (e.g. OOM)
                import traceback

                results["failed"] = {
                    "step": step,
                    "kind": kind,
                    "error": f"{type(err).__name__}: {err}"[:2000],
                    "traceback": traceback.format_exc()[-4000:],
                }
                save()
                log(f"step {step} {kind}: FAILED {results['failed']['error'][:400]}")
                break
            gs._sync(device)
            wall_s = time.perf_counter() - began
            t.step = step
            t.log.log(step, metrics)
            calls = sampling.calls[calls_before:]
            clock = env.clocks[-1] if multi and len(env.clocks) > clocks_before else None
            row = step_row(kind, step, wall_s, metrics, calls, clock, info.world_size, counts,
                           ceil)  # fmt: skip
            rows[kind].append(row)
            results["steps"].append(row)
            save()
            log(
                f"step {step} {kind}: {wall_s:.1f} s (generation {row['generation_s']:.1f}, "
                f"environment {row['environment_s']:.2f}, rewards {row['reward_s']:.2f}, "
                f"training {row['training_s']:.1f}), {row['turns_per_trajectory']:.2f} turns, "
                f"{row['model_tokens']} model / {row['context_tokens']} context tokens: "
                f"{row['model_tokens_per_s_per_gpu']:,.0f} / "
                f"{row['context_tokens_per_s_per_gpu']:,.0f} tok/s/GPU, {row['trained_tokens']} "
                f"trained; per turn "
                f"{[round(c['seconds'], 2) for c in row['turns']]} s"
            )
        results["summary"] = {kind: summarise(r) for kind, r in rows.items() if r}
        multi, single = (results["summary"].get(k) for k in ("multi_turn", "single_turn"))
        if multi and single:
            results["summary"]["multi_over_single"] = {
                key: multi[key] / single[key] for key in RATIO_KEYS if single[key]
            }
        save()
        t.backend.close()
        t.log.close()
        if (run_dir / "rollouts").is_dir():  # logging.rollout_dump_period: rows with loss masks
            shutil.copytree(run_dir / "rollouts", args.out / "rollouts", dirs_exist_ok=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print_summary(results)
    parallel.shutdown()


def print_summary(results: dict) -> None:
    print(f"\n== multi-turn GRPO step ({results['device']}) ==", flush=True)
    w = results["workload"]
    print(f"{w['prompts']} prompts x {w['samples']} trajectories, cap {w['max_new_tokens']} per "
          f"turn, stop set vocab/{w['stop_every']}; medians of each kind's steps after its first")  # fmt: skip
    if "failed" in results:
        f = results["failed"]
        print(f"step {f['step']} ({f['kind']}) FAILED: {f['error'][:400]}; the steps before it:")
    for kind, s in results["summary"].items():
        if kind == "multi_over_single":
            print("multi / single: " + ", ".join(f"{k} {v:.2f}x" for k, v in s.items()))
            continue
        parts = s.get("environment_parts")
        env = (f" (tool {parts['tool_s']:.2f}, render {parts['render_s']:.2f}, "
               f"rest {parts['rest_s']:.2f})") if parts else ""  # fmt: skip
        print(
            f"{kind}: step {s['wall_s']:.1f} s = generation {s['generation_s']:.1f} "
            f"(per turn {', '.join(f'{x:.1f}' for x in s['per_turn_seconds'])}) + environment "
            f"{s['environment_s']:.2f}{env} + rewards {s['reward_s']:.2f} + training "
            f"{s['training_s']:.1f} (logprobs {s['logprobs_s']:.1f}, update {s['update_s']:.1f})"
            f" + refresh {s['weight_refresh_s']:.2f} + other {s['other_s']:.2f}; "
            f"{s['turns_per_trajectory']:.2f} turns/trajectory; tokens/s/GPU: "
            f"{s['model_tokens_per_s_per_gpu']:,.0f} model-generated "
            f"({s['model_tokens_per_trajectory']:.0f} a trajectory), "
            f"{s['context_tokens_per_s_per_gpu']:,.0f} all in context "
            f"({s['context_tokens_per_trajectory']:.0f} a trajectory, "
            f"{s['environment_tokens']} environment tokens a step, "
            f"{s['environment_tokens_per_tool_call']:.0f} a tool result; trained "
            f"{s['trained_tokens']} of {s['model_tokens']} model tokens); update MFU "
            f"{100 * s['update_mfu']:.1f}%; peak GiB {s['peak_gib']}"
        )


# ----------------------------------------------------------------------------- driver


def overrides(args, checkpoint: Path) -> list[str]:
    """grpo_shaped.py's `step` part overrides (its recipe, caps, no validation/checkpoints)."""
    shaped = argparse.Namespace(
        tiny=args.tiny, parts=["step"], long_max_new_tokens=args.max_new_tokens,
        max_new_tokens=args.max_new_tokens, tp=1, prompts=args.prompts, samples=args.samples,
        steps=args.steps + args.single_steps, max_batch_size=args.max_batch_size,
        compile_decode=args.compile_decode, override=args.override,
    )  # fmt: skip
    return gs.recipe_overrides(shaped, checkpoint)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    parser.add_argument("--tiny", action="store_true", help="tiny model, fp32: CPU smoke test")
    parser.add_argument("--prompts", type=int, default=None, help="prompts a step (64; tiny 4)")
    parser.add_argument("--samples", type=int, default=None, help="trajectories each (8; 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="cap per model turn (256; tiny 16)")  # fmt: skip
    parser.add_argument("--stop-every", type=int, default=80, help="stop set = vocab / this")
    parser.add_argument("--turns", type=int, default=3, help="model turns per trajectory")
    parser.add_argument("--tool-words", default="8,64",
                        help="a tool result's words, seeded uniform in MIN,MAX")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="multi-turn steps (3; tiny 1)")
    parser.add_argument("--single-steps", type=int, default=None,
                        help="one-turn reference steps, interleaved (2; tiny 1)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=0,
                        help="generation.max_batch_size (0: the engine sizes it)")  # fmt: skip
    parser.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="generation.compile_decode (default: on, off with --tiny)")  # fmt: skip
    parser.add_argument("--recipe", type=Path, default=gs.RECIPE)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra recipe override (repeatable)")  # fmt: skip
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="random checkpoint folder (default $TMPDIR/rlflow-bench-3b, "
                        "grpo_shaped.py's; tiny: rlflow-bench-tiny)")  # fmt: skip
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.prompts = args.prompts or (4 if tiny else 64)
    args.samples = args.samples or (2 if tiny else 8)
    args.max_new_tokens = args.max_new_tokens or (16 if tiny else 256)
    args.steps = args.steps or (1 if tiny else 3)
    args.single_steps = args.single_steps if args.single_steps is not None else (1 if tiny else 2)
    if args.compile_decode is None:
        args.compile_decode = not tiny
    try:
        low, high = (int(x) for x in args.tool_words.split(","))
    except ValueError:
        parser.error(f"--tool-words: MIN,MAX words, e.g. 8,64 (got {args.tool_words!r})")
    if not 0 <= low <= high:
        parser.error(f"--tool-words: 0 <= MIN <= MAX (got {args.tool_words!r})")
    args.tool_words = (low, high)
    if args.turns < 1:
        parser.error("--turns: at least 1")
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    args.checkpoint = args.checkpoint or tmp / ("rlflow-bench-tiny" if tiny else "rlflow-bench-3b")
    return args


def main() -> None:
    from rlflow.compat import library_logs

    args = parse_args()
    library_logs.quiet()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    log_file = (args.out / "log.txt").open("w")

    def log(message: str) -> None:
        line = f"[{time.perf_counter() - began:6.1f} s] {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    results: dict = {
        "torch": torch.__version__,
        "argv": sys.argv[1:],
        "model_preset": "tiny" if args.tiny else "qwen25vl-3b",
        "workload": {
            "prompts": args.prompts,
            "samples": args.samples,
            "max_new_tokens": args.max_new_tokens,
            "stop_every": args.stop_every,
            "turns": args.turns,
            "tool_words": list(args.tool_words),
            "seed": args.seed,
            "steps": args.steps,
            "single_steps": args.single_steps,
        },
    }

    def save() -> None:
        (args.out / RESULTS).write_text(json.dumps(results, indent=2, default=gs._plain))

    run(args, log, results, save)


if __name__ == "__main__":
    main()
