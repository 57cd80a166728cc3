"""Does the time-limit warning survive NCCL? Two ranks on two GPUs of one host, under rlflow's
node launcher, all-reducing 256 MiB tensors back to back; the warning is sent to the launcher
in the middle of those collectives (and again every 2 s until the job ends, as a re-sent warning
would). Each rank must hear it, agree with its peer at the next step boundary, save a checkpoint
(real tensors, then --save-seconds of extra "slow storage" time, longer than the launcher's 5 s
repeat interval), ignore further warnings, and exit 75; the launcher must then exit 75.

Run for each stop signal the ranks can hear (slurm.stop_signal: USR1, HUP). Prints one JSON
summary; exit 0 only if every case passed. Self-contained: torch with NCCL, and rlflow from
PYTHONPATH (no install). About a minute on 2 H200s:

    PYTHONPATH=. python benchmarks/signal_nccl.py
    PYTHONPATH=. python benchmarks/signal_nccl.py --signals USR1 --save-seconds 12

`--train` also runs the real trainer (`rlflow train` on the tiny recipe, 2 ranks, NCCL) and
sends the warning at step 3; it needs megatron-core and takes a few minutes more.
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
from types import SimpleNamespace

from rlflow.errors import EX_TEMPFAIL
from rlflow.job import files

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


# --- one rank --------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from rlflow.train import watchdog
    from rlflow.train.signals import StopRequest

    watchdog.start()
    watchdog.configure(
        SimpleNamespace(
            enabled=True,
            startup_timeout_s=300,
            preflight_timeout_s=300,
            model_load_timeout_s=300,
            checkpoint_timeout_s=300,
            phase_timeout_s=120,
        )
    )
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.cpu:  # a smoke test of this script without GPUs (gloo)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    stop = StopRequest(True, os.environ["RLFLOW_STOP_SIGNAL"])  # as rlflow train installs it
    heard_at: list[int] = []
    step = 0
    handler = signal.getsignal(stop_signal())

    def record(signum, frame):  # when, in steps, the warning arrived
        heard_at.append(step)
        handler(signum, frame)

    signal.signal(stop_signal(), record)
    x = torch.ones(2**20 if args.cpu else 64 * 2**20, device=device)  # 256 MiB of fp32 on GPUs
    while True:
        step += 1
        watchdog.beat("collectives", step)
        for _ in range(10):
            dist.all_reduce(x)
            x.div_(dist.get_world_size())
        flag = torch.tensor([1.0 if stop.signal_name else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
        if step >= args.max_steps:
            print(f"rank {rank}: no warning after {step} steps", flush=True)
            return 3
    stop.stopping()
    watchdog.beat("checkpoint_save")
    start = time.perf_counter()
    folder = Path(args.run_dir) / "checkpoint"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"rank-{rank}.pt"
    torch.save({"step": step, "x": x.cpu()}, target.with_suffix(".tmp"))
    os.replace(target.with_suffix(".tmp"), target)
    time.sleep(args.save_seconds)  # a 3B checkpoint with optimizer state takes this long
    dist.barrier()
    print(
        f"rank {rank}: heard {stop.signal_name} at step(s) {heard_at}; stopping at step {step}: "
        f"checkpoint {target} saved in {time.perf_counter() - start:.1f} s, exit 75",
        flush=True,
    )
    dist.destroy_process_group()
    return EX_TEMPFAIL


def stop_signal() -> signal.Signals:
    from rlflow.train.signals import warning_signal

    return warning_signal(os.environ["RLFLOW_STOP_SIGNAL"])


# --- the launcher (2 local ranks) --------------------------------------------------------------


def launch_main(args: argparse.Namespace) -> int:
    from rlflow.job.local import run_local

    command = [sys.executable, str(HERE), "--rank", "--run-dir", args.run_dir]
    command += ["--save-seconds", str(args.save_seconds), "--max-steps", str(args.max_steps)]
    command += ["--cpu"] if args.cpu else []
    return run_local(command, 2, Path(args.run_dir), startup_timeout=300, stop_signal=args.signal)


# --- the driver ----------------------------------------------------------------------------------


def heartbeats(run_dir: Path) -> list[dict]:
    found = []
    # The launcher keeps them in its attempt's folder, status/attempt-<A> (rlflow/job/files.py)
    attempts = files.attempt_dirs(run_dir)
    folder = attempts[-1] / files.HEARTBEAT if attempts else run_dir / "none"
    for path in sorted(folder.glob("rank-*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return found


def run_case(name: str, command: list[str], run_dir: Path, ready, args) -> dict:
    """Start `command` (a launcher), send SIGUSR1 once `ready(heartbeats)`, then every 2 s."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in [k for k in env if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))]:
        del env[key]
    started = time.monotonic()
    launcher = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    signalled = None
    steps_at_signal = None
    while launcher.poll() is None and time.monotonic() - started < args.case_timeout:
        beats = heartbeats(run_dir)
        if signalled is None and ready(beats):
            steps_at_signal = [b.get("step") for b in beats]
            launcher.send_signal(signal.SIGUSR1)
            signalled = last = time.monotonic()
        elif signalled is not None and time.monotonic() - last >= 2.0:
            launcher.send_signal(signal.SIGUSR1)  # a re-sent warning must change nothing
            last = time.monotonic()
        time.sleep(0.05)
    if launcher.poll() is None:
        launcher.kill()
    output = launcher.communicate()[0]
    logs = {p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("rank-*.log")}
    return {
        "case": name,
        "exit_code": launcher.returncode,
        "steps_at_signal": steps_at_signal,
        "seconds_signal_to_exit": (
            round(time.monotonic() - signalled, 1) if signalled is not None else None
        ),
        "launcher_passed_it_on": "time-limit warning (SIGUSR1): passing it on" in output,
        "launcher_output_tail": output.splitlines()[-6:],
        "rank_log_tails": {name: text.splitlines()[-3:] for name, text in sorted(logs.items())},
    }


def loop_case(sig: str, args) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"signal-nccl-{sig}-"))
    command = [sys.executable, str(HERE), "--launch", "--signal", sig, "--run-dir", str(run_dir)]
    command += ["--save-seconds", str(args.save_seconds), "--max-steps", str(args.max_steps)]
    command += ["--cpu"] if args.cpu else []
    ready = lambda beats: len(beats) == 2 and min(b.get("step", 0) for b in beats) >= 20  # noqa: E731
    backend = "gloo (--cpu)" if args.cpu else "nccl"
    result = run_case(
        f"{backend} all-reduce loop, ranks hear SIG{sig}", command, run_dir, ready, args
    )
    saved = sorted(p.name for p in (run_dir / "checkpoint").glob("rank-*.pt"))
    heard = all(f"heard SIG{sig}" in "\n".join(tail) for tail in result["rank_log_tails"].values())
    result.update(
        stop_signal=sig,
        checkpoint_files=saved,
        ranks_heard_it=heard,
        ok=result["exit_code"] == EX_TEMPFAIL and saved == ["rank-0.pt", "rank-1.pt"] and heard,
    )
    return result


def train_case(sig: str, args) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"signal-nccl-train-{sig}-"))
    recipe = REPO / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
    command = [sys.executable, "-m", "rlflow.cli", "train", str(recipe), "model.dtype=bfloat16"]
    command += ["warm_start.num_steps=0", "grpo.max_num_steps=200", "grpo.val_at_start=false"]
    command += ["checkpointing.save_period=1000", f"slurm.stop_signal={sig}"]
    command += ["logging.progress_bar=false", "--nproc", "2", "--run-dir", str(run_dir)]
    ready = lambda beats: len(beats) == 2 and min(b.get("step", 0) for b in beats) >= 3  # noqa: E731
    result = run_case(
        f"rlflow train (tiny, NCCL), ranks hear SIG{sig}", command, run_dir, ready, args
    )
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    result.update(
        stop_signal=sig,
        checkpoints=saved,
        ok=result["exit_code"] == EX_TEMPFAIL and bool(saved),
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--signals", nargs="+", default=["USR1", "HUP"], choices=["USR1", "HUP"])
    parser.add_argument("--save-seconds", type=float, default=8.0)
    parser.add_argument("--max-steps", type=int, default=100000)
    parser.add_argument("--case-timeout", type=float, default=150.0)
    parser.add_argument("--train", action="store_true", help="also run the real trainer")
    parser.add_argument("--cpu", action="store_true", help="smoke-test on CPU (gloo), no GPUs")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--signal", default="USR1", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank_main(args)
    if args.launch:
        return launch_main(args)

    import torch

    cases = [loop_case(sig, args) for sig in args.signals]
    if args.train:
        cases += [train_case(sig, args) for sig in args.signals]
    summary = {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version()))
        if torch.cuda.is_available()
        else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "save_seconds": args.save_seconds,
        "cases": cases,
        "ok": all(c["ok"] for c in cases),
    }
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
