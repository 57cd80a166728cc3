"""`rlflow status JOB --watch`: the screen from real run-directory files, and the live monitor in
a pseudo-terminal against the real local Slurm cluster, running the real trainer.

The screen tests write the run directory with the writers the trainer uses (watchdog heartbeats,
MetricsLog, attempts.jsonl records); the Slurm test runs the real console script in a pty,
watches it redraw, presses Ctrl-C and checks the terminal is given back.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from rlflow.job.attempts import Attempt, append
from rlflow.launch import monitor
from tests.slurm.jobs import (
    PYTHON,
    RECIPES,
    REPO,
    batch_log,
    rlflow,
    submit,
    wait_done,
    wait_for_state,
)

RLFLOW = Path(PYTHON).parent / "rlflow"  # the console script users run


def _trainer_files(run_dir: Path, monkeypatch) -> None:
    """A run directory as a requeued trainer leaves it: attempt 0 stopped for the time limit at
    step 3, attempt 1 is in step 5 on two ranks."""
    from rlflow.train import watchdog
    from rlflow.train.metrics import MetricsLog

    (run_dir / "recipe.yaml").write_text("grpo:\n  max_num_steps: 20\n")
    log = MetricsLog(run_dir, enabled=True, tensorboard=False, progress_bar=False, total_steps=20)
    log.log(0, {"val/accuracy": 0.25, "val/reward": 0.4})
    for step in range(1, 5):
        log.log(
            step,
            {
                "time/step": 1.0 + step / 10,
                "time/generation": 0.25,
                "time/logprobs": 0.5,
                "time/training": 0.25 + step / 10,
                "speed/step_tokens_per_s": 1000.0 + step,
                "train/reward": 0.5 + step / 100,
                "train/accuracy": 0.3,
            },
        )
    append(
        run_dir,
        Attempt(0, "77", "time-limit", "saved and stopped for the time limit", "node1", [], 3, 3,
                75, "requeue"),
    )  # fmt: skip
    beats = run_dir / "status" / "attempt-1" / "heartbeat"
    beats.mkdir(parents=True)
    for rank, phase in ((0, "logprobs"), (1, "training")):
        monkeypatch.setattr(watchdog._state, "path", str(beats / f"rank-{rank}.json"))
        watchdog.beat(phase, 5)
    monkeypatch.setattr(watchdog._state, "path", None)


def test_screen_of_a_running_requeued_job(tmp_path, monkeypatch):
    _trainer_files(tmp_path, monkeypatch)
    job = monitor.JobView(
        "77",
        {
            "JobState": "RUNNING",
            "JobName": "tiny",
            "RunTime": "00:02:10",
            "TimeLimit": "00:10:00",
            "NodeList": "node2",
            "Reason": "None",
        },
    )
    screen = monitor.render(job, monitor.read_run(tmp_path), time.time())
    assert screen[:3] == ["job 77 (tiny)", "queue:      RUNNING, 00:02:10 of 00:10:00 on node2",
                          f"run dir:    {tmp_path}"]  # fmt: skip
    assert re.fullmatch(
        r"phase:      logprobs, step 5 of 20 \(attempt 1, 2 ranks reporting, oldest report \d s ago\)",
        screen[3],
    )
    assert screen[4:] == [
        "speed:      1,002 tokens/s per step (median of the last 4 steps; newest step 4)",
        "step time:  1.25 s = logprobs 0.50, training 0.50, generation 0.25",
        "ETA:        0:00:20 (16 steps x median step time, to grpo.max_num_steps=20)",
        "rewards:    train reward 0.540, accuracy 0.30 (step 4), validation accuracy 0.250 (step 0)",
        "attempts:   now attempt 1; 1 time-limit requeue, 0 node-failure retries",
        "  0: time-limit at step 3 on node1 -> requeue",
        "last error: none",
    ]


def test_screen_names_the_first_failure(tmp_path, monkeypatch):
    _trainer_files(tmp_path, monkeypatch)
    (tmp_path / "status" / "attempt-1" / "first-failure").write_text(
        "1\nrank 1 failed: ValueError: bad reward\nnode3\n"
    )
    job = monitor.JobView(
        "77", {"JobState": "FAILED", "JobName": "tiny", "Reason": "NonZeroExitCode"}
    )
    screen = monitor.render(job, monitor.read_run(tmp_path), time.time())
    assert "queue:      FAILED, ? of ? (NonZeroExitCode)" in screen
    assert (
        screen[-1] == "last error: attempt 1: rank 1 failed: ValueError: bad reward (exit 1, node3)"
    )


def test_screen_of_a_pending_job_shows_the_start_estimate():
    job = monitor.JobView(
        "78",
        {"JobState": "PENDING", "JobName": "big", "Reason": "Resources"},
        "2026-12-01T03:00:00",
    )
    assert monitor.render(job, None, 0.0)[1] == (
        "queue:      PENDING (Resources), estimated start 2026-12-01T03:00:00 (squeue --start)"
    )
    unknown = monitor.JobView("79", {"JobState": "PENDING", "Reason": "Priority"}, "N/A")
    assert "no start estimate yet" in monitor.render(unknown, None, 0.0)[1]


# --- the live monitor on the real cluster -------------------------------------------------------


class Pty:
    """The real console script on a pseudo-terminal (its controlling terminal, so the Ctrl-C
    byte becomes SIGINT for it like in a shell)."""

    def __init__(self, *args: str, cwd: Path, sigint_ignored: bool = False):
        """sigint_ignored: started with SIGINT ignored, as a shell without job control starts
        its background jobs (`cmd &` in a script)."""
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))

        def take_terminal():
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            if sigint_ignored:
                signal.signal(signal.SIGINT, signal.SIG_IGN)

        self.process = subprocess.Popen(
            [str(RLFLOW), *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=take_terminal,
        )
        os.close(slave)
        self.output = b""

    def read_until(self, predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not predicate(self.text):
            if time.monotonic() > deadline:
                pytest.fail(f"the monitor's screen never matched; it showed:\n{self.text[-3000:]}")
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:  # EIO: the process has exited and the pty is closed
                    if self.process.poll() is not None:
                        pytest.fail(
                            f"the monitor exited ({self.process.returncode}) before its screen "
                            f"matched; it showed:\n{self.text[-3000:]}"
                        )
        return self.text

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")

    def screens(self) -> list[str]:
        """Every complete redraw (each starts at the cursor's home position)."""
        return self.text.split(monitor.HOME)[1:-1]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        os.close(self.master)


def _step_of(screen: str) -> int:
    found = re.search(r"phase:\s+\w+, step (\d+)", screen)
    return int(found[1]) if found else -1


@pytest.mark.usefixtures("slurm_cluster")
def test_live_monitor_in_a_pty_on_the_real_cluster(tmp_path):
    """A pending job shows squeue's start estimate; a running trainer's screen refreshes with its
    step; Ctrl-C leaves with exit 130 (SIGTERM with 143), the terminal restored and no
    traceback; and a monitor left running exits by itself, 0, when the job completes, without
    importing torch."""
    # A job that needs every node waits behind one that holds a node; backfill estimates its
    # start from the holder's time limit.
    holder, _ = submit(RECIPES / "tiny-cpu.yaml", "--nodes", "1", "--gpus", "4", cwd=tmp_path,
                       command="sleep 600")  # fmt: skip
    wait_for_state(holder, {"RUNNING"}, 120)
    big, _ = submit(RECIPES / "tiny-cpu.yaml", "grpo.num_prompts_per_step=36", "--nodes", "9",
                    "--gpus", "4", cwd=tmp_path, command="true")  # fmt: skip
    # started with SIGINT ignored (a script's background job): Ctrl-C still leaves
    pending = Pty("status", big, "--watch", "--interval", "1", cwd=tmp_path, sigint_ignored=True)
    try:
        text = pending.read_until(lambda t: "estimated start 20" in t, 240)
        assert f"job {big} (tiny-cpu)" in text and "PENDING (Resources)" in text
        os.write(pending.master, b"\x03")
        pending.read_until(lambda t: "left the monitor" in t, 30)
        assert pending.process.wait(30) == 130
    finally:
        pending.close()
    # SIGTERM (a closing tmux pane, `kill`) leaves the same way: terminal restored, exit 143.
    killed = Pty("status", big, "--watch", "--interval", "1", cwd=tmp_path)
    try:
        killed.read_until(lambda t: f"job {big} (tiny-cpu)" in t, 60)
        killed.process.terminate()
        text = killed.read_until(lambda t: "left the monitor" in t, 30)
        assert killed.process.wait(30) == 143
        assert monitor.LEAVE_SCREEN in text[text.rindex(monitor.HOME) :]
        assert "Traceback" not in text
    finally:
        killed.close()
    for done in (big, holder):
        assert rlflow("cancel", done, cwd=tmp_path).returncode == 0

    def tiny_job(steps: int) -> tuple[str, Path]:
        return submit(
            REPO / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml",
            f"run.output_dir={tmp_path}",
            f"grpo.max_num_steps={steps}",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "warm_start.num_steps=0",
            "grpo.val_at_start=false",
            "grpo.val_period=0",
            "checkpointing.save_period=1000",
            "--nodes",
            "1",
            "--gpus",
            "1",
            cwd=REPO,
        )

    # Long enough never to end while watched (an idle machine runs a tiny step in ~5 s).
    job, run_dir = tiny_job(200)
    watching = Pty("status", str(run_dir), "--watch", "--interval", "1", cwd=tmp_path)
    try:
        watching.read_until(lambda t: "tokens/s per step (median" in t, 600)
        first = _step_of(watching.screens()[-1] if watching.screens() else "")
        watching.read_until(lambda t: any(_step_of(s) > first for s in watching.screens()), 300)
        screen = watching.screens()[-1]
        assert f"job {job} (tiny-clevr-cpu)" in screen
        assert "queue:      RUNNING, " in screen and " of 01:00:00 on node" in screen
        assert re.search(r"phase:\s+\w+, step \d+ of 200 \(attempt 0, 1 rank reporting", screen)
        times = re.search(r"step time:  [\d.]+ s = (.*)\x1b", screen)[1]
        assert {"generation", "logprobs", "training"} <= {p.split()[0] for p in times.split(", ")}
        assert re.search(r"ETA:        \d:\d\d:\d\d \(\d+ steps x median step time", screen)
        assert "attempts:   now attempt 0; 0 time-limit requeues" in screen
        assert "last error: none" in screen
        os.write(watching.master, b"\x03")
        text = watching.read_until(lambda t: "left the monitor" in t, 30)
        assert watching.process.wait(30) == 130
    finally:
        watching.close()
    after = text[text.rindex(monitor.HOME) :]
    assert monitor.LEAVE_SCREEN in after  # cursor shown, the alternate screen left
    assert text.index(monitor.ENTER_SCREEN) < text.index(monitor.HOME)
    assert f"job {job} keeps running" in after
    assert "Traceback" not in text and "Aborted" not in text
    assert rlflow("cancel", job, cwd=tmp_path).returncode == 0

    # Not a terminal: screens one after the other, until a short job ends by itself.
    job, run_dir = tiny_job(2)
    probe = (
        "import sys\nfrom rlflow.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    status = done.code\n"
        "heavy = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]\n"
        "print('heavy modules:', heavy, file=sys.stderr)\nsys.exit(status)\n"
    )
    ended = subprocess.run(
        [PYTHON, "-c", probe, "status", job, "--watch", "--interval", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ended.returncode == 0, ended.stdout[-2000:] + ended.stderr + batch_log(run_dir, job)
    assert f"rlflow: job {job} ended: COMPLETED" in ended.stderr
    assert "heavy modules: []" in ended.stderr
    last = ended.stdout.strip().split("\n\n")[-1]
    assert "queue:      COMPLETED" in last and "ETA:        all 2 steps done" in last
    assert monitor.ENTER_SCREEN not in ended.stdout  # no terminal codes into a pipe
    assert wait_done(job, 60, run_dir)["JobState"] == "COMPLETED"


@pytest.mark.usefixtures("slurm_cluster")
def test_live_monitor_of_a_sweep_until_it_ends(tmp_path):
    """`rlflow status SWEEP_DIR --watch`: the sweep's screen (one line per element), redrawn until
    every element has ended; exit 0 when all completed. Not a terminal: screens one after the
    other, no terminal codes."""
    result = rlflow(
        "submit", str(RECIPES / "tiny-cpu.yaml"), "--sweep", "slurm.env.WHICH=a,b",
        "--nodes", "1", "--gpus", "1", "--command", "sleep 3", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sweep_dir = Path(re.search(r"sweep dir: (.*)", result.stdout)[1].strip())
    watched = subprocess.run(
        [str(RLFLOW), "status", str(sweep_dir), "--watch", "--interval", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert watched.returncode == 0, watched.stdout[-2000:] + watched.stderr
    assert f"rlflow: sweep {sweep_dir.name} ended: COMPLETED" in watched.stderr
    screens = watched.stdout.strip().split("\n\n")
    assert all(s.startswith("rlflow monitor, ") for s in screens)
    last = screens[-1].splitlines()
    assert last[1].startswith(f"sweep {sweep_dir.name}: job array ") and "2 COMPLETED" in last[1]
    assert [line.split()[2] for line in last[3:]] == ["COMPLETED", "COMPLETED"]
    assert monitor.ENTER_SCREEN not in watched.stdout
