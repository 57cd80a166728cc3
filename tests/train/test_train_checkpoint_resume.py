"""Checkpoints that verify themselves: real saves through `Checkpointer` (one rank, torch modules
standing in for the policy's chunks), damaged in every way the issue found, then resumed; and one
real `rlflow train` run resumed past a damaged checkpoint and a torn metrics line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.errors import RlflowError

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
FILES = ("model_tp0_pp0.pt", "optim_tp0_pp0.pt", "rng_rank0.pt", "trainer.json")


def _policy(seed: int):
    import torch

    torch.manual_seed(seed)
    chunks = [torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)]
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=1e-3)
    loss = sum(c.weight.sum() for c in chunks)
    loss.backward()
    optimizer.step()  # Adam now has state to save
    return chunks, optimizer


def _save(run_dir: Path, steps=(1, 2), keep_last: int = 5, seed: int = 0):
    from rlflow.train.checkpoint import Checkpointer

    checkpointer = Checkpointer(run_dir, keep_last=keep_last)
    chunks, optimizer = _policy(seed)
    checkpointer.save_reference(chunks)
    for step in steps:
        checkpointer.save(step, chunks, optimizer, {"sampler": {"position": step}})
    return checkpointer


def _fresh():
    return _policy(seed=99)


@pytest.fixture
def saved(single_rank, tmp_path):
    return _save(tmp_path)


def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "missing":
        path.unlink()
    else:  # 64 bytes overwritten, same size: the silent case in the issue
        data = bytearray(path.read_bytes())
        start = min(len(data) // 3, max(len(data) - 64, 0))
        data[start : start + 64] = bytes(b ^ 0x5A for b in data[start : start + 64])
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "missing", "overwritten"])
@pytest.mark.parametrize("name", [*FILES, "manifest.json"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(saved, name, how, capfd):
    newest = saved.root / "step_000002"
    _damage(newest / name, how)
    chosen = saved.latest()
    assert chosen == saved.root / "step_000001"
    err = capfd.readouterr().err
    assert f"warning[checkpoint.damaged]: checkpoint {newest} is damaged: " in err
    assert name in err.splitlines()[0]
    assert "kept as step_000002.damaged for inspection; nothing was loaded from it" in err
    assert (saved.root / "step_000002.damaged" / "manifest.json").exists() or name == (
        "manifest.json"
    )
    # What is loaded is exactly what step 1 saved (seed 0's weights, not the fresh seed 99's).
    import torch

    chunks, optimizer = _fresh()
    state = saved.load(chosen, chunks, optimizer)
    assert state["step"] == 1 and state["sampler"] == {"position": 1}
    expected, _ = _policy(seed=0)
    for got, want in zip(chunks, expected, strict=True):
        assert torch.equal(got.weight, want.weight)
    reference, _ = _fresh()
    assert saved.load_reference(reference)


def test_no_verified_checkpoint_stops_instead_of_starting_over(saved, capfd):
    _damage(saved.root / "step_000002" / "rng_rank0.pt", "truncated")
    _damage(saved.root / "step_000001" / "trainer.json", "overwritten")
    with pytest.raises(RlflowError) as caught:
        saved.latest()
    assert caught.value.exit_code == 2
    assert caught.value.diagnostics[0].code == "checkpoint.none-verified"
    assert "step_000001.damaged, step_000002.damaged" in caught.value.diagnostics[0].message
    # A second attempt (a requeue) does not start from scratch either.
    with pytest.raises(RlflowError):
        saved.latest()
    assert "rng_rank0.pt is" in capfd.readouterr().err


@pytest.mark.parametrize("how", ["truncated", "missing", "overwritten"])
def test_damaged_reference_is_an_error_naming_the_file(saved, how):
    _damage(saved.root / "reference" / "model_tp0_pp0.pt", how)
    with pytest.raises(RlflowError) as caught:
        saved.load_reference(_fresh()[0])
    (problem,) = caught.value.diagnostics
    assert problem.code == "checkpoint.damaged" and problem.severity == "error"
    assert "reference is damaged: model_tp0_pp0.pt" in problem.message


def _not_a_file(path: Path, kind: str) -> str:
    """A named pipe, a link to /dev/zero or a sparse 100 MiB file in place of `path`."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return "it is a named pipe (FIFO), not a regular file"
    if kind == "zero":
        path.symlink_to("/dev/zero")
        return "it links to /dev/zero, which is a character device, not a regular file"
    with open(path, "wb") as out:
        out.truncate(100 << 20)
    return "it is 100.0 MiB, over 64.0 MiB, the most rlflow reads of it"


# A read that waits on a named pipe fails by this timeout, not by hanging the suite.
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "kind"),
    [("manifest.json", "fifo"), ("manifest.json", "zero"), ("trainer.json", "zero")],
)
def test_a_checkpoint_file_that_is_not_a_file_is_damage_named(saved, name, kind, capfd):
    """Issue 36, item 4: resume never waits on a pipe nor reads /dev/zero; it names what the
    file is and falls back to the previous checkpoint."""
    newest = saved.root / "step_000002"
    what = _not_a_file(newest / name, kind)
    assert saved.latest() == saved.root / "step_000001"
    err = capfd.readouterr().err
    assert f"checkpoint {newest} is damaged: {name} cannot be read: {what}" in err
    assert (saved.root / "step_000002.damaged").is_dir()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fifo", "huge"])
def test_trainer_state_replaced_after_it_verified_is_a_diagnostic(saved, kind):
    path = saved.root / "step_000002" / "trainer.json"
    what = _not_a_file(path, kind)
    with pytest.raises(RlflowError) as caught:
        saved.load(saved.root / "step_000002", *_fresh())
    (problem,) = caught.value.diagnostics
    assert problem.code == "checkpoint.load"
    assert problem.message == f"cannot load {path}: {what}"


def test_a_checkpoint_from_another_model_is_a_diagnostic(saved):
    import torch

    other = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)]
    with pytest.raises(RlflowError) as caught:
        saved.load(saved.root / "step_000002", other, _fresh()[1])
    assert caught.value.diagnostics[0].code == "checkpoint.load"
    assert "model_tp0_pp0.pt" in caught.value.diagnostics[0].message


def test_keep_last_never_deletes_the_newest_verified_checkpoint(single_rank, tmp_path):
    checkpointer = _save(tmp_path, steps=(1, 2), keep_last=5)
    _damage(tmp_path / "checkpoints" / "step_000002" / "optim_tp0_pp0.pt", "truncated")
    checkpointer.keep_last = 1
    checkpointer._prune()  # keep_last=1 alone would delete step 1, the only good one
    assert [p.name for p in checkpointer.checkpoints()] == ["step_000001", "step_000002"]
    checkpointer.save(3, *_policy(1), {"sampler": {}})
    assert [p.name for p in checkpointer.checkpoints()] == ["step_000003"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_byte_flip_in_any_checkpoint_file_is_detected(saved, data):
    from rlflow.train import manifest

    directory = saved.root / data.draw(st.sampled_from(["step_000002", "reference"]))
    names = sorted(p.name for p in directory.iterdir() if p.name != "manifest.json")
    name = data.draw(st.sampled_from(names))
    path = directory / name
    original = path.read_bytes()
    offset = data.draw(st.integers(0, len(original) - 1))
    mask = data.draw(st.integers(1, 255))
    flipped = bytearray(original)
    flipped[offset] ^= mask
    path.write_bytes(bytes(flipped))
    try:
        assert manifest.verify(directory) == [
            f"{name} has the right size but other contents (checksum differs)"
        ]
    finally:
        path.write_bytes(original)
    assert manifest.verify(directory) == []


NO_SPACE = r"no space left on {} \(tmpfs\) \(needed 0\.0000\d\d GB, had 0\.0000\d\d GB\)"


@pytest.fixture
def tmpfs(tmp_path):
    mounts = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True
        )
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_full_disk_before_a_save_keeps_the_previous_checkpoint(single_rank, tmpfs):
    from rlflow.train import manifest, storage
    from rlflow.train.checkpoint import Checkpointer

    disk = tmpfs("1m")
    checkpointer = Checkpointer(disk, keep_last=5)
    chunks, optimizer = _policy(0)
    checkpointer.save(1, chunks, optimizer, {})
    size = manifest.total_size(disk / "checkpoints" / "step_000001")
    # Leave less free space than one more checkpoint takes.
    (disk / "filler").write_bytes(bytes(storage.free_bytes(disk) - size // 2))
    with pytest.raises(RlflowError) as caught:
        checkpointer.save(2, chunks, optimizer, {})
    (problem,) = caught.value.diagnostics
    assert problem.code == "disk.no-space"
    assert re.fullmatch(NO_SPACE.format(re.escape(str(disk))), problem.message), problem.message
    assert [p.name for p in (disk / "checkpoints").iterdir()] == ["step_000001"]
    assert manifest.verify(disk / "checkpoints" / "step_000001") == []


def test_disk_filling_up_during_a_save_says_no_space(single_rank, tmpfs):
    from rlflow.train.checkpoint import Checkpointer

    disk = tmpfs("8k")  # smaller than one checkpoint: a write fails part-way
    checkpointer = Checkpointer(disk, keep_last=5)
    with pytest.raises(RlflowError) as caught:
        checkpointer.save(1, *_policy(0), {})
    (problem,) = caught.value.diagnostics
    assert problem.code == "disk.no-space"
    assert re.fullmatch(NO_SPACE.format(re.escape(str(disk))), problem.message), problem.message
    assert "the unfinished step_000001.tmp was removed" in problem.notes[0]
    assert list((disk / "checkpoints").iterdir()) == []


# --- the real trainer --------------------------------------------------------------------------

FAST = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.num_minibatches=1",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "warm_start.num_steps=0",
    "checkpointing.save_period=1",
    "checkpointing.keep_last=3",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "data.train.num_samples=64",
    "generation.max_new_tokens=4",
]


def rlflow_train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rlflow.cli",
            "train",
            str(RECIPE),
            *FAST,
            *overrides,
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**clean, "PYTHONUNBUFFERED": "1"},
    )


def test_train_resumes_past_a_damaged_checkpoint_and_a_torn_metrics_line(tmp_path):
    first = rlflow_train(tmp_path, "grpo.max_num_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    _damage(tmp_path / "checkpoints" / "step_000002" / "model_tp0_pp0.pt", "overwritten")
    with open(tmp_path / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 3, "train/rew')  # a run killed while writing its line
    resumed = rlflow_train(tmp_path, "grpo.max_num_steps=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    err = resumed.stderr
    assert (
        f"warning[checkpoint.damaged]: checkpoint {tmp_path}/checkpoints/step_000002 is damaged: "
        "model_tp0_pp0.pt has the right size but other contents (checksum differs)"
    ) in err
    assert f"resumed from {tmp_path}/checkpoints/step_000001 (step 1)" in err
    assert "metrics.jsonl: removed a torn last line" in err
    assert "Traceback" not in err
    assert (tmp_path / "checkpoints" / "step_000002.damaged").is_dir()
    # Step 2 ran again from step 1's state: one line per step, and a new step 2 that verifies.
    from rlflow.train import manifest
    from rlflow.train.metrics import read_metrics

    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert manifest.verify(tmp_path / "checkpoints" / "step_000002") == []


def test_train_in_a_read_only_run_directory_is_a_diagnostic(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], check=True)
    try:
        result = rlflow_train(mount, "grpo.max_num_steps=1")
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error[rundir.not-writable]: the run directory {mount} is not writable: " in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
