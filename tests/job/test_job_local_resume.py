"""`rlflow train --nproc 2` with the real trainer stops on a closed terminal and on SIGTERM with
a saved checkpoint (exit 75, as on the time-limit warning), and each time the same command
resumes it: no step lost, none repeated. It is also the suite's end-to-end run of two
data-parallel ranks (`--nproc 2`): the checkpoint records world size 2.

The ranks run in sessions of their own (rlflow/job/ranks.py), so no signal reaches them from the
terminal: the launcher turns SIGHUP, SIGINT and SIGTERM alike (rlflow/job/local.py SAVE_ON) into
the same stop request to the ranks. One launcher-sent signal with the real trainer is therefore
enough here; the launcher's handling of each of the three (Ctrl-C included, and a second Ctrl-C)
is tests/job/test_job_local.py's, with stand-in ranks."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

from rlflow.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
RLFLOW = Path(sys.executable).parent / "rlflow"  # the console script users run
# Tiny steps, no periodic checkpoint: every checkpoint here is one a signal asked for.
OVERRIDES = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.num_minibatches=1",
    "grpo.max_num_steps=1000",
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
HANG_GUARD_SECONDS = 600  # not a speed check: reaching it fails the test


def command(run_dir: Path) -> list[str]:
    return [
        str(RLFLOW),
        "train",
        str(RECIPE),
        *OVERRIDES,
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
    ]


def environment() -> dict[str, str]:
    skip = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    clean = {k: v for k, v in os.environ.items() if k not in skip and not k.startswith("SLURM")}
    return {**clean, "PYTHONUNBUFFERED": "1"}


def in_a_terminal(run_dir: Path) -> tuple[subprocess.Popen, int]:
    """The command with a pty as its controlling terminal, in a session of its own: a shell in
    a terminal window or an ssh session. Returns the process and the pty's master end."""
    master, slave = os.openpty()
    process = subprocess.Popen(
        command(run_dir),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=environment(),
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )
    os.close(slave)
    return process, master


def wait_for_step(run_dir: Path, process: subprocess.Popen, after: int, master: int | None = None):
    """Until metrics.jsonl records a step past `after`; the terminal (if any) is read meanwhile,
    so the run never blocks writing to it."""
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while not (run_dir / "metrics.jsonl").is_file() or all(
        r["step"] <= after for r in read_metrics(run_dir)
    ):
        assert process.poll() is None, f"the run ended ({process.returncode}) before step {after}"
        assert time.monotonic() < deadline, f"no step past {after} in {HANG_GUARD_SECONDS} s"
        if master is not None and select.select([master], [], [], 0.2)[0]:
            os.read(master, 65536)
        else:
            time.sleep(0.2)


def stopped_at(run_dir: Path) -> int:
    """The step rank 0 said it saved at, in its log's last run."""
    last_run = (run_dir / "logs" / "rank-0.log").read_text().rsplit("==== rlflow: rank 0 ", 1)[1]
    line = next(x for x in last_run.splitlines() if x.startswith("stopping at step "))
    assert "checkpoint saved, exit 75" in line, line
    return int(line.split()[3])


def resumed_from(run_dir: Path) -> str:
    last_run = (run_dir / "logs" / "rank-0.log").read_text().rsplit("==== rlflow: rank 0 ", 1)[1]
    return next(x for x in last_run.splitlines() if "resumed from" in x)


def test_a_closed_terminal_and_sigterm_each_save_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    # 1. The terminal closes (ssh dropped): the kernel hangs up the run's controlling terminal.
    process, master = in_a_terminal(run_dir)
    wait_for_step(run_dir, process, 0, master)
    os.close(master)
    assert process.wait(timeout=HANG_GUARD_SECONDS) == 75
    first = stopped_at(run_dir)
    assert (run_dir / "checkpoints" / f"step_{first:06d}").is_dir()
    # 2. Resumed by the same command, then SIGTERM (`kill`, a closing tmux pane).
    previous = first
    for signum in (signal.SIGTERM,):
        with open(tmp_path / f"{signum.name}.out", "w") as out:
            process = subprocess.Popen(
                command(run_dir), cwd=ROOT, env=environment(), stdout=out, stderr=out
            )
            wait_for_step(run_dir, process, previous)
            process.send_signal(signum)
            assert process.wait(timeout=HANG_GUARD_SECONDS) == 75, (
                tmp_path / f"{signum.name}.out"
            ).read_text()
        said = (tmp_path / f"{signum.name}.out").read_text()
        assert f"{signum.name}: asking the ranks to save and stop" in said
        assert f"(step {previous})" in resumed_from(run_dir)
        step = stopped_at(run_dir)
        assert step > previous and (run_dir / "checkpoints" / f"step_{step:06d}").is_dir()
        previous = step
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(1, previous + 1))  # every step once: none lost, none repeated
    # Two data-parallel ranks trained each step: the checkpoint says so and each has its log.
    state = json.loads(
        (run_dir / "checkpoints" / f"step_{previous:06d}" / "trainer.json").read_text()
    )
    assert state["world_size"] == 2
    assert (run_dir / "logs" / "rank-1.log").is_file()
    # `rlflow status` sees the local run: two attempts, each stopped by its signal, and how
    # to resume it.
    status = subprocess.run(
        [str(RLFLOW), "status", str(run_dir)], capture_output=True, text=True, env=environment()
    )
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(
        "local run run: STOPPED, attempt 1 saved and stopped on SIGTERM"
    )
    for attempt, signum in enumerate(("SIGHUP", "SIGTERM")):
        assert f"       saved and stopped on {signum}" in status.stdout
        assert f"    {attempt}: stopped on " in status.stdout
    assert f"  metrics: step {previous} of 1000 logged; train reward " in status.stdout
    assert f"continues from checkpoint step {previous}" in status.stdout
