"""Checkpoint manifests: every file's size and checksum, written last, checked before loading.

    step_000010/manifest.json
      {"format": 1, "step": 10, "files": {"model_tp0_pp0.pt": {"size": 4910, "blake2b": "..."}, ...}}

Each rank hashes the files it wrote (reading them back from disk) into a part file; the main rank
merges the parts into `manifest.json` (temp file, fsync, rename) just before the checkpoint
directory is renamed into place. A checkpoint verifies when the manifest reads, lists every file
the directory holds, and every file has its size and checksum. No torch here: `rlflow status`
and tests can verify a checkpoint cheaply.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
PARTS = ".manifest-parts"
FORMAT = 1
_CHUNK = 1 << 20


def checksum(path: Path) -> str:
    """blake2b-128 of the file's bytes (hashlib's; ~1 GB/s on one core)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
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
        files.update(json.loads(part.read_text()))
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
        manifest = json.loads((directory / MANIFEST).read_text())
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
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return [f"{MANIFEST}: format {manifest.get('format')!r} is not {FORMAT}"]
        entries = {str(n): (int(e["size"]), str(e["blake2b"])) for n, e in files.items()}
    except FileNotFoundError:
        return [f"{MANIFEST} is missing (written by an older rlflow, or the folder was edited)"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"{MANIFEST} is unreadable or damaged ({type(err).__name__}: {err})"]
    problems = [f"{name} is missing from {MANIFEST}" for name in sorted(expected - set(entries))]
    for name, (size, digest) in entries.items():
        path = directory / name
        if Path(name).name != name or name in (MANIFEST, ""):
            problems.append(f"{MANIFEST} lists {name!r}, which is not a file name")
            continue
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as err:
            problems.append(f"{name} cannot be read: {err.strerror}")
            continue
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
