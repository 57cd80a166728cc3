"""Faults of the real trainer on 2 ranks under NCCL (issue 22, part 4), on one host.

`rlflow train --nproc 2` on the tiny recipe (bf16 on GPUs, NCCL; fp32 and gloo with --cpu),
watched by rlflow's node launcher, as under Slurm. Cases (--cases, any subset):

- warning-HUP, warning-USR1: slurm.stop_signal set to that signal (HUP is base.yaml's default,
  USR1 the other choice); the time-limit warning (SIGUSR1, as Slurm's --signal=B:USR1 sends it) goes
  to the launcher once both ranks are past step 2, and again every 2 s. Expected: both ranks save
  a checkpoint and exit 75, the launcher exits 75; the same command then resumes from that step
  (rank 0's log says "resumed from ... (step N)") and runs to grpo.max_num_steps, exit 0.
- sigstop: rank 1 SIGSTOPped inside a step (watchdog.phase_timeout_s = --phase-timeout).
  Expected: the job ends (exit 77) within the phase timeout + 60 s of the SIGSTOP, its message
  names rank 1, and the stack dump file (logs/hang-attempt0-node0.txt) holds rank 1's stack.
- sigkill: rank 1 SIGKILLed inside a step. Expected: the job ends within --kill-limit seconds
  (default 30), non-zero.

Writes OUT/faults_nccl.json (one record per case: exit codes, seconds, the lines checked, ok)
and prints it; exit 0 only if every case passed. The command (2 GPUs of one host):

    PYTHONPATH=. python benchmarks/multi_gpu/faults_nccl.py --out $OUT

CPU smoke test (gloo, fp32; every case but the NCCL part of the claim):

    uv run python benchmarks/multi_gpu/faults_nccl.py --cpu --out /tmp/faults-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
CASES = ("warning-HUP", "warning-USR1", "sigstop", "sigkill")
# Small steps, no periodic checkpoint: every checkpoint here is one a signal asked for.
OVERRIDES = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.num_minibatches=1",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "warm_start.num_steps=0",
    "checkpointing.save_period=1000",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "data.train.num_samples=64",
    "generation.max_new_tokens=4",
]


def command(run_dir: Path, args, *extra: str) -> list[str]:
    dtype = "float32" if args.cpu else "bfloat16"
    return [
        sys.executable,
        "-m",
        "rlflow.cli",
        "train",
        str(RECIPE),
        *OVERRIDES,
        f"model.dtype={dtype}",
        *extra,
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
    ]


def environment(cpu: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in [k for k in env if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))]:
        del env[key]
    env.pop("LOCAL_RANK", None)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return {**env, "PYTHONUNBUFFERED": "1"}


def beats(run_dir: Path) -> dict[int, dict]:
    """Each rank's heartbeat (rlflow/train/watchdog.py): pid, phase, step."""
    found = {}
    from rlflow.job import files

    attempts = files.attempt_dirs(run_dir)  # `rlflow train --nproc`'s newest attempt's folder
    folder = attempts[-1] / files.HEARTBEAT if attempts else run_dir / "none"
    for path in folder.glob("rank-*.json"):
        try:
            found[int(path.stem.split("-")[1])] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return found


def wait_until(process: subprocess.Popen, run_dir: Path, ready, limit: float) -> dict[int, dict]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = beats(run_dir)
        if len(found) == 2 and ready(found):
            return found
        if process.poll() is not None:
            raise RuntimeError(f"the run ended ({process.returncode}) before the fault")
        time.sleep(0.05)
    raise RuntimeError(f"not ready in {limit} s: {beats(run_dir)}")


def rank0_log(run_dir: Path) -> str:
    path = run_dir / "logs" / "rank-0.log"
    return path.read_text(errors="replace") if path.is_file() else ""


def warning_case(sig: str, args, root: Path) -> dict:
    run_dir = root / f"warning-{sig}"
    extra = [f"slurm.stop_signal={sig}", f"grpo.max_num_steps={args.steps}"]
    out = open(root / f"warning-{sig}.out", "w")
    process = subprocess.Popen(
        command(run_dir, args, *extra),
        cwd=REPO,
        env=environment(args.cpu),
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    wait_until(
        process,
        run_dir,
        lambda b: min(x.get("step", 0) for x in b.values()) >= 2,
        args.case_timeout,
    )
    sent = last = time.monotonic()
    process.send_signal(signal.SIGUSR1)
    while process.poll() is None and time.monotonic() - sent < args.case_timeout:
        if time.monotonic() - last >= 2.0:
            process.send_signal(signal.SIGUSR1)  # a re-sent warning must change nothing
            last = time.monotonic()
        time.sleep(0.05)
    if process.poll() is None:
        process.kill()
    stop_code, stop_seconds = process.wait(), time.monotonic() - sent
    stopped = [x for x in rank0_log(run_dir).splitlines() if x.startswith("stopping at step ")]
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    resumed = subprocess.run(
        command(run_dir, args, *extra),
        cwd=REPO,
        env=environment(args.cpu),
        stdout=out,
        stderr=subprocess.STDOUT,
        timeout=args.case_timeout * 4,
    )
    last_run = rank0_log(run_dir).rsplit("==== rlflow: rank 0 ", 1)[-1]
    resumed_line = next((x for x in last_run.splitlines() if "resumed from" in x), None)
    out.close()
    ok = (
        stop_code == 75
        and bool(stopped)
        and "checkpoint saved, exit 75" in stopped[-1]
        and bool(saved)
        and resumed.returncode == 0
        and resumed_line is not None
    )
    return {
        "case": f"warning-{sig}",
        "stop_signal": sig,
        "exit_code": stop_code,
        "seconds_warning_to_exit": round(stop_seconds, 1),
        "stopped_line": stopped[-1] if stopped else None,
        "checkpoints": saved,
        "resume_exit_code": resumed.returncode,
        "resumed_line": resumed_line,
        "ok": ok,
    }


def fault_case(name: str, args, root: Path) -> dict:
    run_dir = root / name
    timeout = args.phase_timeout
    extra = [
        f"watchdog.phase_timeout_s={timeout}",
        f"watchdog.collective_timeout_s={timeout * 4}",
        "grpo.max_num_steps=1000",
    ]
    out_path = root / f"{name}.out"
    with open(out_path, "w") as out:
        process = subprocess.Popen(
            command(run_dir, args, *extra),
            cwd=REPO,
            env=environment(args.cpu),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        found = wait_until(process, run_dir, lambda b: b[1].get("step", 0) >= 2, args.case_timeout)
        os.kill(found[1]["pid"], signal.SIGSTOP if name == "sigstop" else signal.SIGKILL)
        hit = time.monotonic()
        limit = timeout + 60 if name == "sigstop" else args.kill_limit
        try:
            code = process.wait(timeout=max(limit, 1) * 3)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        seconds = time.monotonic() - hit
    output = out_path.read_text(errors="replace")
    record = {
        "case": name,
        "exit_code": code,
        "seconds_fault_to_exit": round(seconds, 1),
        "limit_s": limit,
        "output_tail": output.splitlines()[-8:],
    }
    if name == "sigstop":
        named = [x for x in output.splitlines() if "rank 1 " in x and "made no progress" in x]
        dump = run_dir / "logs" / "hang-attempt0-node0.txt"
        text = dump.read_text(errors="replace") if dump.is_file() else ""
        record.update(
            named_line=named[0] if named else None,
            stack_dump=str(dump),
            dump_has_rank_1="==== rank 1 " in text,
        )
        record["ok"] = code == 77 and seconds < limit and bool(named) and "==== rank 1 " in text
    else:
        record["ok"] = code != 0 and seconds < limit
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for faults_nccl.json")
    parser.add_argument("--cases", default=",".join(CASES), help=f"any of {','.join(CASES)}")
    parser.add_argument("--cpu", action="store_true", help="gloo, fp32: a smoke test, no GPUs")
    parser.add_argument("--steps", type=int, default=6, help="grpo.max_num_steps (warning)")
    parser.add_argument("--phase-timeout", type=int, default=60, help="watchdog.phase_timeout_s")
    parser.add_argument("--kill-limit", type=float, default=30.0, help="seconds (sigkill)")
    parser.add_argument("--case-timeout", type=float, default=600.0, help="hang guard per case")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; use {','.join(CASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="faults-nccl-"))
    records = []
    for case in cases:
        try:
            if case.startswith("warning-"):
                records.append(warning_case(case.split("-", 1)[1], args, root))
            else:
                records.append(fault_case(case, args, root))
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            records.append({"case": case, "ok": False, "error": str(error)})
        print(json.dumps(records[-1]), flush=True)
    import torch

    summary = {
        "backend": "gloo (--cpu)" if args.cpu else "nccl",
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "work_dir": str(root),
        "cases": records,
        "ok": all(r["ok"] for r in records),
    }
    (args.out / "faults_nccl.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
