"""Checkpoint manifests, the torn metrics line and the run directory's disk, without torch:
what `rlflow train` relies on to never load damaged state silently."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.train import manifest, storage
from rlflow.train.metrics import MetricsLog, read_metrics


def make_checkpoint(directory: Path, files: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    manifest.write_part(directory, 0, list(files))
    manifest.write_manifest(directory, 1)
    return directory


FILES = {
    "model_tp0_pp0.pt": os.urandom(5000),
    "optim_tp0_pp0.pt": os.urandom(9000),
    "rng_rank0.pt": os.urandom(700),
    "trainer.json": b'{"step": 1, "world_size": 1}',
}


def test_manifest_lists_every_file_and_verifies(tmp_path):
    ckpt = make_checkpoint(tmp_path / "step_000001", FILES)
    written = json.loads((ckpt / "manifest.json").read_text())
    assert written["format"] == 1 and written["step"] == 1
    assert {n: e["size"] for n, e in written["files"].items()} == {
        n: len(d) for n, d in FILES.items()
    }
    assert manifest.verify(ckpt) == []
    assert not (ckpt / manifest.PARTS).exists()  # the ranks' parts are merged and removed
    assert manifest.total_size(ckpt) == sum(len(d) for d in FILES.values())


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("truncate", "model_tp0_pp0.pt is 4000 bytes, the manifest says 5000 (truncated)"),
        ("missing", "model_tp0_pp0.pt is missing"),
        ("overwrite", "model_tp0_pp0.pt has the right size but other contents (checksum differs)"),
        ("append", "model_tp0_pp0.pt is 5001 bytes, the manifest says 5000 (longer than written)"),
    ],
)
def test_each_kind_of_damage_is_named(tmp_path, damage, expected):
    ckpt = make_checkpoint(tmp_path / "step_000001", FILES)
    path = ckpt / "model_tp0_pp0.pt"
    if damage == "truncate":
        os.truncate(path, 4000)
    elif damage == "missing":
        path.unlink()
    elif damage == "overwrite":  # the case: 64 bytes overwritten, same size
        with open(path, "r+b") as f:
            f.seek(1000)
            f.write(bytes(64))
    else:
        with open(path, "ab") as f:
            f.write(b"x")
    assert manifest.verify(ckpt) == [expected]


def test_manifest_missing_damaged_or_incomplete(tmp_path):
    ckpt = make_checkpoint(tmp_path / "step_000001", FILES)
    needed = {"rng_rank1.pt"}
    assert manifest.verify(ckpt, expected=needed) == ["rng_rank1.pt is missing from manifest.json"]
    (ckpt / "manifest.json").write_text('{"format": 1, "files": {"model_tp0_pp0.pt": ')
    assert manifest.verify(ckpt)[0].startswith("manifest.json is unreadable or damaged")
    (ckpt / "manifest.json").unlink()
    assert manifest.verify(ckpt)[0].startswith("manifest.json is missing")


def test_sizes_only_check_skips_checksums(tmp_path):
    ckpt = make_checkpoint(tmp_path / "step_000001", FILES)
    with open(ckpt / "optim_tp0_pp0.pt", "r+b") as f:
        f.write(b"\xff" * 8)
    assert manifest.verify(ckpt, deep=set()) == []  # what keep_last's quick check sees
    assert manifest.verify(ckpt, deep={"optim_tp0_pp0.pt"}) != []


# --- files that are not files: bounded reads (issue 36, item 4) ---------------------------------

MEMORY = 2 << 30  # far above what verifying needs, far below what /dev/zero offers

# Run in a child process with a time and address-space limit: a read that waits on a named pipe
# fails the test by its timeout, a read of /dev/zero by MemoryError, neither takes the host.
_PROBE = """
import json, sys
from pathlib import Path
from rlflow.train import manifest
ckpt = Path(sys.argv[1])
out = {"verify": manifest.verify(ckpt), "total_size": manifest.total_size(ckpt)}
if (ckpt / manifest.PARTS).exists():
    try:
        manifest.write_manifest(ckpt, 1)
    except OSError as err:
        out["write_manifest"] = str(err)
print(json.dumps(out))
"""


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def probe(ckpt: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(ckpt)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_limited,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def put(path: Path, kind: str) -> str:
    """A named pipe, a link to /dev/zero, or a sparse 100 MiB file at `path`; what it is said to
    be."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return "it is a named pipe (FIFO), not a regular file"
    if kind == "zero":
        path.symlink_to("/dev/zero")
        return "it links to /dev/zero, which is a character device, not a regular file"
    with open(path, "wb") as out:
        out.truncate(100 << 20)
    return "it is 100.0 MiB, over 64.0 MiB, the most rlflow reads of it"


@pytest.mark.parametrize("kind", ["fifo", "zero", "huge"])
def test_a_manifest_that_is_not_a_file_is_named_not_waited_on(tmp_path, kind):
    ckpt = make_checkpoint(tmp_path / "step_000001", FILES)
    what = put(ckpt / "manifest.json", kind)
    (ckpt / manifest.PARTS).mkdir()
    put(ckpt / manifest.PARTS / "rank0.json", kind)  # a rank's part, read by the main rank
    found = probe(ckpt)
    assert found["verify"] == [f"manifest.json cannot be read: {what}"]
    assert found["total_size"] is None  # the free-space check then asks for nothing
    assert found["write_manifest"] == f"{ckpt / manifest.PARTS / 'rank0.json'}: {what}"


@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("name", ["trainer.json", "model_tp0_pp0.pt"])
def test_a_checkpoint_file_that_is_not_a_file_is_named_not_hashed(tmp_path, name, kind):
    """A shard is hashed at any size, but only a regular file: the damage names what it is."""
    ckpt = make_checkpoint(tmp_path / "step_000001", FILES)
    what = put(ckpt / name, kind)
    assert probe(ckpt)["verify"] == [f"{name} cannot be read: {what}"]


# --- metrics.jsonl -----------------------------------------------------------------------------


def test_torn_last_metrics_line_is_removed_with_a_note(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a": 3.0}\n{"step": 4, "a'
    )
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    log = MetricsLog(tmp_path, enabled=True, tensorboard=False, progress_bar=False, total_steps=9)
    log.start(2)
    assert path.read_text() == '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n'
    assert "metrics.jsonl: removed a torn last line" in capsys.readouterr().err


def test_damaged_metrics_line_in_the_middle_is_an_error_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(RlflowError) as caught:
        read_metrics(tmp_path)
    (problem,) = caught.value.diagnostics
    assert problem.code == "metrics.damaged" and problem.line == 2
    assert problem.file == str(tmp_path / "metrics.jsonl")


# --- the run directory's disk ------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB file system (tests run as root, like the Slurm tests)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_no_space_names_the_device_and_both_sizes(small_tmpfs):
    err = storage.no_space(small_tmpfs, needed=3_400_000_000, had=1_048_576, detail="saving")
    (problem,) = err.diagnostics
    assert problem.message == (
        f"no space left on {small_tmpfs} (tmpfs) (needed 3.40 GB, had 0.001049 GB)"
    )
    assert err.exit_code == 2
    assert storage.free_bytes(small_tmpfs / "not" / "yet") <= 1 << 20


def test_read_only_run_directory_is_a_diagnostic(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], check=True)
    try:
        with pytest.raises(RlflowError) as caught:
            storage.prepare_run_dir(mount / "run")
        (problem,) = caught.value.diagnostics
        assert problem.code == "rundir.not-writable"
        assert f"the run directory {mount / 'run'} is not writable: Read-only file system" in (
            problem.message
        )
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
