"""Checkpoint manifests: every file's size and checksum, written last, checked before loading.

    step_000010/manifest.json
      {"format": 1, "step": 10, "files": {"model_tp0_pp0.pt": {"size": 4910, "blake2b": "..."}, ...}}

Each rank hashes the files it wrote (reading them back from disk) into a part file; the main rank
merges the parts into `manifest.json` (temp file, fsync, rename) just before the checkpoint
directory is renamed into place. A checkpoint verifies when the manifest reads, lists every file
the directory holds, and every file has its size and checksum. No torch here: `rlflow status`
and tests can verify a checkpoint cheaply.

A checkpoint directory is a place users and other tools can touch: every read here is bounded
(rlflow/bounded.py). The manifest and its parts are read up to MANIFEST_MAX_BYTES; a file is
hashed only when it is a regular file (a named pipe would wait forever, /dev/zero never ends),
at any size. Such a file is named as a problem, so resume sets its checkpoint aside.
"""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

from rlflow import bounded

MANIFEST = "manifest.json"
PARTS = ".manifest-parts"
FORMAT = 1
_CHUNK = 1 << 20
# ~100 bytes per listed file: a manifest of a million files. More is not a manifest.
MANIFEST_MAX_BYTES = 64 << 20
READ_SECONDS = 60.0  # for MANIFEST_MAX_BYTES on a busy shared file system


def read_json(path: Path):
    """A small JSON file of a checkpoint (manifest, part, trainer.json), bounded: raises
    bounded.UnreadableFile (an OSError) for a file that is not regular or is too large."""
    return json.loads(bounded.read_bytes(path, MANIFEST_MAX_BYTES, READ_SECONDS))


def checksum(path: Path) -> str:
    """blake2b-128 of the file's bytes (hashlib's; ~1 GB/s on one core). A regular file only
    (bounded.UnreadableFile otherwise); no size limit: shards are gigabytes."""
    digest = hashlib.blake2b(digest_size=16)
    with bounded.open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe(path: Path) -> dict:
    return {"size": path.stat().st_size, "blake2b": checksum(path)}


def write_part(directory: Path, rank: int, names: list[str]) -> None:
    """This rank's entries (the files it wrote, hashed from disk) for the main rank to merge."""
    entries = {name: describe(directory / name) for name in names}
    parts = directory / PARTS
    parts.mkdir(exist_ok=True)
    _write_atomically(parts / f"rank{rank}.json", json.dumps(entries))


def write_manifest(directory: Path, step: int | None) -> dict:
    """Merge the ranks' parts into manifest.json (atomically); every file must be listed."""
    files: dict[str, dict] = {}
    parts = directory / PARTS
    for part in sorted(parts.glob("rank*.json")):
        try:
            files.update(read_json(part))
        except bounded.UnreadableFile as err:  # the save's error names the part, not just why
            raise bounded.UnreadableFile(err.errno, f"{part}: {err}", part) from None
    unlisted = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name not in files)
    for name in unlisted:  # written by the main rank outside write_part (none today)
        files[name] = describe(directory / name)
    manifest = {"format": FORMAT, "step": step, "files": dict(sorted(files.items()))}
    _write_atomically(directory / MANIFEST, json.dumps(manifest, indent=1))
    for part in parts.glob("*"):
        part.unlink()
    parts.rmdir()
    return manifest


def total_size(directory: Path) -> int | None:
    """Bytes the checkpoint's files take, from its manifest; None without a readable one."""
    try:
        manifest = read_json(directory / MANIFEST)
        return sum(int(entry["size"]) for entry in manifest["files"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def verify(
    directory: Path, deep: set[str] | None = None, expected: set[str] = frozenset()
) -> list[str]:
    """What is wrong with a checkpoint directory, one line per problem ([] when it verifies).

    Sizes of all files are always checked; checksums of the files in `deep` (all when None).
    `expected` names files this run needs, which the manifest must list."""
    try:
        manifest = read_json(directory / MANIFEST)
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return [f"{MANIFEST}: format {manifest.get('format')!r} is not {FORMAT}"]
        entries = {str(n): (int(e["size"]), str(e["blake2b"])) for n, e in files.items()}
    except FileNotFoundError:
        return [f"{MANIFEST} is missing (written by an older rlflow, or the folder was edited)"]
    except bounded.UnreadableFile as err:
        return [f"{MANIFEST} cannot be read: {err}"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"{MANIFEST} is unreadable or damaged ({type(err).__name__}: {err})"]
    problems = [f"{name} is missing from {MANIFEST}" for name in sorted(expected - set(entries))]
    for name, (size, digest) in entries.items():
        path = directory / name
        if Path(name).name != name or name in (MANIFEST, ""):
            problems.append(f"{MANIFEST} lists {name!r}, which is not a file name")
            continue
        try:
            found = path.stat()  # follows links: a link to /dev/zero is a device
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as err:
            problems.append(f"{name} cannot be read: {err.strerror}")
            continue
        if not stat.S_ISREG(found.st_mode):
            problems.append(f"{name} cannot be read: {bounded.not_regular(path, found.st_mode)}")
            continue
        actual = found.st_size
        if actual != size:
            what = "truncated" if actual < size else "longer than written"
            problems.append(f"{name} is {actual} bytes, the manifest says {size} ({what})")
        elif (deep is None or name in deep) and _checksum_or_none(path) != digest:
            problems.append(f"{name} has the right size but other contents (checksum differs)")
    return problems


def _checksum_or_none(path: Path) -> str | None:
    try:
        return checksum(path)
    except OSError:
        return None


def _write_atomically(path: Path, text: str) -> None:
    from rlflow.train.storage import replace_file

    replace_file(path, text)
