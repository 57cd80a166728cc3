"""metrics.jsonl on resume: the torn-line repair is killed mid-write and loses nothing.

The repair runs in a child process whose file-size limit (RLIMIT_FSIZE) is below the size of
the repaired file, with SIGXFSZ at its default action: the kernel kills it at that byte of
its write, a real kill at a known point (Python itself ignores SIGXFSZ).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.train.metrics import METRICS_FILE, MetricsLog, read_metrics

REPAIR = """
import resource, signal, sys
from pathlib import Path
from rlflow.train.metrics import MetricsLog

limit = int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # the kernel's default: end the process
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
log = MetricsLog(Path(sys.argv[1]), enabled=True, tensorboard=False, progress_bar=False, total_steps=200)
log.start(150)  # the resume: from the checkpoint of step 150
"""


def test_a_resume_killed_while_it_repairs_metrics_loses_no_step(tmp_path):
    lines = [json.dumps({"step": s, "train/reward": s / 200}) for s in range(1, 201)]
    path = tmp_path / METRICS_FILE
    path.write_text("\n".join(lines) + '\n{"step": 201, "train/rew')  # torn by the crash
    kept = sum(len(line) + 1 for line in lines[:150])
    root = Path(__file__).resolve().parents[2]
    killed = subprocess.run(
        [sys.executable, "-c", REPAIR, str(tmp_path), str(kept // 2)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 201))
    repaired = subprocess.run(
        [sys.executable, "-c", REPAIR, str(tmp_path), str(10 * kept)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert repaired.returncode == 0, repaired.stderr
    assert "removed a torn last line" in repaired.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 151))


def _log(run_dir: Path, tensorboard: bool = False) -> MetricsLog:
    return MetricsLog(
        run_dir, enabled=True, tensorboard=tensorboard, progress_bar=False, total_steps=9
    )


def test_starting_over_forgets_every_record_and_resuming_those_after_the_checkpoint(
    tmp_path, capsys
):
    path = tmp_path / METRICS_FILE
    # An older rlflow's rerun repeated steps 1-2; the last record of each step is the survivor's.
    old = [(1, 0.1), (2, 0.2), (1, 1.1), (2, 1.2), (3, 1.3), (4, 1.4)]
    path.write_text("".join(json.dumps({"step": s, "a": a}) + "\n" for s, a in old))
    _log(tmp_path).start(2)
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1.1}, {"step": 2, "a": 1.2}]
    assert "removed steps 3-4, logged after the checkpoint of step 2: they run again" in (
        capsys.readouterr().err
    )
    _log(tmp_path).start(None)  # no checkpoint survived: the run starts over
    assert path.read_text() == ""
    assert "removed steps 1-2, logged by an attempt that left no checkpoint" in (
        capsys.readouterr().err
    )


def test_tensorboard_shows_each_step_once_with_the_resumed_attempts_values(tmp_path):
    """TensorBoard's own reader (EventAccumulator) over two attempts' event files: the second,
    resumed from step 2, purges what the first logged after it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = _log(tmp_path, tensorboard=True)
    first.start(None)
    for step in (1, 2, 3, 4):
        first.log(step, {"train/reward": step / 10})
    first.close()
    second = _log(tmp_path, tensorboard=True)
    second.start(2)
    for step in (3, 4, 5):
        second.log(step, {"train/reward": step})
    second.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("train/reward")]
    assert scalars == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, 3), (4, 4), (5, 5)]


@pytest.fixture
def small_disk(tmp_path):
    """A real 64 KiB disk (tmpfs), unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], check=True)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_full_disk_is_a_diagnostic_and_the_next_start_repairs_what_it_left(small_disk):
    from rlflow.errors import RlflowError

    log = _log(small_disk)
    for step in range(1, 11):
        log.log(step, {"train/reward": step / 10})
    filler = small_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk to its last byte
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    with pytest.raises(RlflowError) as caught:  # the file's last page fills up, then no more
        for step in range(11, 1000):
            log.log(step, {"train/reward": step / 10, "time/step": 0.5})
    (problem,) = caught.value.diagnostics
    assert problem.code == "metrics.write-failed"
    assert f"(appending step {step}): No space left on device" in problem.message
    before = (small_disk / METRICS_FILE).read_bytes()
    with pytest.raises(RlflowError) as caught:  # the next attempt, still on a full disk
        _log(small_disk).start(5)
    assert (
        "(cutting it back to the checkpoint): No space left" in caught.value.diagnostics[0].message
    )
    assert (small_disk / METRICS_FILE).read_bytes() == before  # as the failed attempt left it
    assert not (small_disk / (METRICS_FILE + ".tmp")).exists()
    filler.unlink()  # space freed: the same command again
    _log(small_disk).start(5)
    assert [r["step"] for r in read_metrics(small_disk)] == [1, 2, 3, 4, 5]
