"""`rlflow init-tiny-model` on ordinary mistakes (issue 36, item 6): an empty DIRECTORY (it wrote
into the current directory), a path under a file, a folder that already holds something (its
config.json was replaced without a word), an unknown device, a GPU that is not there, a full
disk: each is exit 2 with what to do, never a traceback, and nothing half-written. Through the
console script, as users run it."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

RLFLOW = Path(sys.executable).parent / "rlflow"


def init(*args: str, cwd: Path, preexec=None) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(RLFLOW), "init-tiny-model", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=preexec,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([""], "DIRECTORY is empty: the checkpoint would be written into the current directory"),
        (["a-file/tiny"], "a-file/tiny cannot be created: {cwd}/a-file is a file, not a folder"),
        (["checkpoint"], "checkpoint is not empty (it holds config.json)"),
        (
            ["notes", "--overwrite"],
            "notes holds files but no checkpoint (no config.json): --overwrite replaces only",
        ),
        (["new", "--device", "tpu"], "--device 'tpu' is not a device init-tiny-model writes"),
        (["x" * 300 + "/tiny"], "/tiny cannot be used: File name too long"),
        (["new", "--seed", str(2**64)], "Invalid value for '--seed': 18446744073709551616 is not"),
    ],
)
def test_a_bad_target_or_device_is_refused_before_anything_is_built(tmp_path, args, message):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    done = init(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message.format(cwd=tmp_path) in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "checkpoint" / "config.json").read_text() == "{}"


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused(tmp_path):
    done = init("tiny", "--device", "cuda", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--device cuda: this machine has no GPU torch can use" in done.stderr
    assert list(tmp_path.iterdir()) == []


def _file_size_limit() -> None:
    """A full disk, for real: writes past 256 kB fail with EFBIG (the model is 4.6 MB). A
    small tmpfs or loop mount would need root; RLIMIT_FSIZE makes write(2) itself fail, as a
    full disk does, once SIGXFSZ (which would kill the process instead) is ignored."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))


@pytest.mark.slow
def test_a_failed_write_leaves_the_old_checkpoint_as_it_was(tmp_path):
    """--overwrite replaces a checkpoint only with a whole one: the write fails (the disk is
    "full") and the old checkpoint, and nothing else, is there."""
    old = tmp_path / "checkpoint"
    old.mkdir()
    (old / "config.json").write_text('{"old": true}')
    done = init("checkpoint", "--overwrite", cwd=tmp_path, preexec=_file_size_limit)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error[model.init-write]: cannot write the checkpoint to {old}: File too large" in (
        done.stderr
    )
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]  # no partial folder left
    assert [p.name for p in old.iterdir()] == ["config.json"]
    assert (old / "config.json").read_text() == '{"old": true}'
