"""Rewards whose process dies or exits: real worker processes, real exits, crashes and signals.

A dying worker must stop scoring at once with an error naming the reward and the row, never a
wait for scoring.timeout_s (the timeout here is long enough that a wait would fail the test by
its message, not by its clock). In the trainer's own process (scoring.num_workers: 0) an exit
is an error too, not the end of the process. The time-limit warning and the launcher's stop
go to the rank's whole process group: they must not kill its reward workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rlflow.data.rewards import RewardBatch, RewardError
from rlflow.data.scoring import Scorer

FAULTS = """
import ctypes, os, signal, sys


def _each(batch, fault):
    for f in batch.fields:
        if f["level"] == 2:  # only row r2 fails
            fault()
    return [1.0] * len(batch)


def sys_exit(batch):
    return _each(batch, lambda: sys.exit(0))


def builtin_exit(batch):
    return _each(batch, lambda: exit(3))


def os_exit(batch):
    return _each(batch, lambda: os._exit(0))


def segfault(batch):
    return _each(batch, lambda: ctypes.string_at(0))


def keyboard_interrupt(batch):
    def fault():
        raise KeyboardInterrupt
    return _each(batch, fault)


def sigkill(batch):
    return _each(batch, lambda: os.kill(os.getpid(), signal.SIGKILL))


def c_exit(batch):
    return _each(batch, lambda: ctypes.CDLL(None).exit(0))
"""

TIMEOUT_S = 120.0  # a worker's death must be noticed long before this


@pytest.fixture
def faults_dir(tmp_path):
    (tmp_path / "faults.py").write_text(FAULTS)
    yield tmp_path
    sys.modules.pop("faults", None)


def batch(n: int = 4) -> RewardBatch:
    return RewardBatch(
        prompts=[f"question {i}?" for i in range(n)],
        completions=[f"<answer>{i}</answer>" for i in range(n)],
        completion_tokens=[5] * n,
        finish_reasons=["stop"] * n,
        answers=[str(i) for i in range(n)],
        media=["text"] * n,
        fields=[{"level": i} for i in range(n)],
        sample_ids=[f"r{i}" for i in range(n)],
    )


def score(fn: str, num_workers: int, search_path) -> RewardError:
    weights = {f"faults:{fn}": 1.0}
    with Scorer(weights, "format", num_workers, TIMEOUT_S, search_path=[str(search_path)]) as s:
        with pytest.raises(RewardError) as caught:
            s.score(batch())
    return caught.value


@pytest.mark.parametrize(
    "fn, said",
    [
        ("sys_exit", "called sys.exit(0)"),
        ("builtin_exit", "called sys.exit(3)"),
        ("os_exit", "called os._exit(0)"),
        ("keyboard_interrupt", "raised KeyboardInterrupt"),
        ("segfault", "killed its worker process (SIGSEGV, a crash in native code)"),
        ("sigkill", "killed its worker process (SIGKILL"),
        ("c_exit", "killed its worker process (exit code 0"),
    ],
)
def test_a_worker_that_exits_or_dies_stops_scoring_naming_the_reward_and_row(fn, said, faults_dir):
    error = score(fn, 2, faults_dir)
    message = error.diagnostics[0].message
    assert message.startswith(f"reward `faults:{fn}` {said}"), message
    assert message.endswith("on row r2"), message  # found by retrying the rows one by one
    assert "did not return within" not in message
    assert error.exit_code == 1


@pytest.mark.parametrize(
    "fn, said", [("os_exit", "called os._exit(0)"), ("sys_exit", "called sys.exit(0) (or exit())")]
)
def test_a_reward_in_the_trainer_that_exits_is_an_error_not_the_end_of_it(fn, said, faults_dir):
    """num_workers: 0 runs the reward in this process: in a child, so that a reward that did
    end the process shows here as a missing line, not as the end of pytest."""
    code = textwrap.dedent(f"""
        from rlflow.data.rewards import RewardError
        from rlflow.data.scoring import Scorer
        from tests.data.test_data_reward_workers import batch
        with Scorer({{"faults:{fn}": 1.0}}, "format", 0, 60, search_path=[{str(faults_dir)!r}]) as s:
            try:
                s.score(batch())
            except RewardError as err:
                print("still running after:", err.diagnostics[0].message)
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert result.returncode == 0, result.stderr
    assert f"still running after: reward `faults:{fn}` {said} on row r2" in result.stdout


RANK = """
import os, signal, sys, time
from pathlib import Path
from rlflow.data.reward_pool import RewardPool
from tests.data.test_data_reward_workers import batch

events = Path(sys.argv[1])
heard = []
for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda s, f: (heard.append(s), (events / f"heard-{s}").touch()))
pool = RewardPool(2, [str(events)])
outcome = pool.run("waiting:reward", batch(), 120)
print("outcome:", outcome.value, outcome.error, "heard:", sorted(heard), flush=True)
pool.close()
"""

WAITING = """
import os, time
from pathlib import Path

def reward(batch):
    events = Path(__file__).parent
    (events / f"started-{os.getpid()}").touch()
    while not (events / "go").exists():  # released by the test once the signals are handled
        time.sleep(0.01)
    return [1.0] * len(batch)
"""


def test_the_stop_signals_to_the_process_group_leave_the_reward_workers_alive(tmp_path):
    """The launcher sends the warning (HUP, USR1) and its stop (TERM) to the rank's process
    group, a terminal sends INT: the rank hears them; its workers must finish their call."""
    (tmp_path / "waiting.py").write_text(WAITING)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, str(tmp_path)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as the launcher starts a rank
    )
    try:
        while len(list(tmp_path.glob("started-*"))) < 2:  # both workers are in the call
            assert rank.poll() is None, rank.communicate()
            time.sleep(0.01)
        signals = (signal.SIGHUP, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            os.killpg(rank.pid, sig)
        while not all((tmp_path / f"heard-{int(sig)}").exists() for sig in signals):
            assert rank.poll() is None, rank.communicate()
            time.sleep(0.01)
        (tmp_path / "go").touch()
        out, err = rank.communicate(timeout=120)
    finally:
        if rank.poll() is None:
            rank.kill()
    assert "outcome: [1.0, 1.0, 1.0, 1.0] None" in out, err
    assert "heard: [1, 2, 10, 15]" in out
