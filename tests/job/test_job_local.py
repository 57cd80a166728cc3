"""`rlflow train --nproc N`'s launcher (rlflow/job/local.py) on signals, with stand-in ranks
(no torch): SIGHUP (a closed terminal), SIGINT (Ctrl-C) and SIGTERM ask the ranks to save and
stop, as the time-limit warning does, and the run exits 75; a second Ctrl-C stops it at once.
tests/job/test_job_local_resume.py does it to the real trainer (a closed terminal and SIGTERM:
the ranks hear the same stop request for each of the three) and resumes it."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

PYTHON = sys.executable
# A rank that hears the warning (SIGUSR1) and, with SAVE=1, "saves" and exits 75; with SAVE=0
# it keeps saving until it is stopped.
RANK = """
import os, signal, sys, time
def heard(*_):
    open(os.environ["MARK"] + "heard-" + os.environ["RANK"], "w").close()
    if os.environ["SAVE"] == "1":
        os._exit(75)
signal.signal(signal.SIGUSR1, heard)
open(os.environ["MARK"] + "ready-" + os.environ["RANK"], "w").close()
while True:
    time.sleep(3600)
"""
LOCAL = (
    "import sys\nfrom pathlib import Path\nfrom rlflow.job.local import run_local\n"
    "sys.exit(run_local([sys.executable, '-c', sys.argv[2]], 2, Path(sys.argv[1]),\n"
    "                   startup_timeout=None, stop_signal='USR1'))\n"
)


def start(tmp_path: Path, save: bool) -> subprocess.Popen:
    env = {"MARK": str(tmp_path / "mark-"), "SAVE": "1" if save else "0"}
    return subprocess.Popen(
        [PYTHON, "-c", LOCAL, str(tmp_path / "run"), RANK],
        env={**_clean_env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _clean_env() -> dict[str, str]:
    skip = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in skip and not k.startswith("SLURM")}


def wait_for(paths: list[Path], process: subprocess.Popen, timeout: float = 120) -> None:
    """Until every file exists (the ranks' own marks); the timeout is a hang guard."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, f"never appeared: {[p.name for p in paths]}"
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGINT, signal.SIGTERM])
def test_hup_int_and_term_save_and_stop_the_run_with_exit_75(tmp_path, signum):
    process = start(tmp_path, save=True)
    wait_for([tmp_path / f"mark-ready-{r}" for r in (0, 1)], process)
    process.send_signal(signum)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 75, output
    name = signal.Signals(signum).name
    assert f"{name}: asking the ranks to save and stop" in output
    assert "ranks 0,1 saved and stopped for a requeue (exit 75)" in output
    assert (tmp_path / "run" / "status" / "attempt-0" / "stopped-node-0").is_file()
    assert not (tmp_path / "run" / "status" / "attempt-0" / "first-failure").exists()


def test_a_second_ctrl_c_stops_the_ranks_at_once(tmp_path):
    process = start(tmp_path, save=False)
    wait_for([tmp_path / f"mark-ready-{r}" for r in (0, 1)], process)
    process.send_signal(signal.SIGINT)
    wait_for([tmp_path / f"mark-heard-{r}" for r in (0, 1)], process)  # saving, for ever
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, output
    assert "SIGINT: stopping the ranks" in output
    assert not (tmp_path / "run" / "status" / "attempt-0" / "stopped-node-0").exists()


def test_a_closed_terminal_saves_and_stops_the_run_which_outlives_its_terminal(tmp_path):
    """The run's controlling terminal hangs up (its window closed, the ssh session dropped): the
    kernel sends SIGHUP, and the launcher's own lines can no longer be written anywhere."""
    master, slave = os.openpty()
    env = {**_clean_env(), "MARK": str(tmp_path / "mark-"), "SAVE": "1"}
    process = subprocess.Popen(
        [PYTHON, "-c", LOCAL, str(tmp_path / "run"), RANK],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )
    os.close(slave)
    wait_for([tmp_path / f"mark-ready-{r}" for r in (0, 1)], process)
    os.close(master)
    assert process.wait(timeout=120) == 75
    assert (tmp_path / "run" / "status" / "attempt-0" / "stopped-node-0").is_file()


RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"


@pytest.mark.parametrize(
    "override, fail, reason",
    [
        # The case: a recipe refusal, met in every rank's setup, before any logging.
        (
            "generation.placement=separate",
            "",
            "error[allocation.placement]: generation.placement is separate",
        ),
        # Rank 1, not rank 0, fails first, with an exception rather than a diagnostic.
        (
            "grpo.max_num_steps=1",
            "1:setup",
            "RuntimeError: injected failure on rank 1 during setup",
        ),
    ],
)
def test_the_first_failing_ranks_error_reaches_the_user(tmp_path, override, fail, reason):
    """`rlflow train ... --nproc 2` through the console script: the user sees why, not only
    "rank R exited with code C" and a pointer to its log."""
    rlflow = Path(sys.executable).parent / "rlflow"
    done = subprocess.run(
        [str(rlflow), "train", str(RECIPE), override, "--nproc", "2", "--run-dir", str(tmp_path)],
        env={**_clean_env(), "RLFLOW_TEST_FAIL": fail},
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard
    )
    assert done.returncode != 0
    failed = "1" if fail else r"[01]"
    assert re.search(rf"rank {failed} exited with code \d+", done.stderr), done.stderr
    assert re.search(rf"rank {failed}'s error, from .*rank-{failed}\.log:", done.stderr)
    assert reason in done.stderr, done.stderr
