"""The shard model, ci-shards.yaml, and what every CI reader shares. A `Shard` is one pytest
argument list CI really runs, with the file:line it is written at, the directory and environment
it runs with, and (for a ci-shards.yaml entry) the CI commands it stands for. This module reads
ci-shards.yaml, the file that describes shards for other CI systems and for commands check-tests
cannot follow (`for:`), and holds the helpers the readers of scripts, Makefiles and workflows
(scripts.py, workflows.py) all use: reading a file as UTF-8, the RF200 "malformed" and RF201
"cannot tell" diagnostics (an RF201 is dropped where a ci-shards.yaml shard describes the
command), and path and line lookups.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError, file_error

SHARDS_FILE = "ci-shards.yaml"


@dataclass(frozen=True)
class Shard:
    name: str  # "file:line (what)" for humans
    file: str
    line: int | None
    args: tuple[str, ...]  # pytest's arguments, exactly as CI passes them
    cwd: str = ""  # where CI runs it, relative to the repository root
    env: tuple[tuple[str, str], ...] = ()
    describes: tuple[str, ...] = ()  # ci-shards.yaml `for:`: the CI commands it stands for


def norm(path: str) -> str:
    resolved = posixpath.normpath(path) if path else "."
    return "" if resolved == "." else resolved


# CI commands ci-shards.yaml describes (`for:`), as shell words joined by spaces; set by
# find_shards while it reads
DESCRIBED: set[str] = set()


def spoken(command: str) -> str:
    from rlflow.cicheck.shell import words

    try:
        return " ".join(words(command))
    except ValueError:
        return " ".join(command.split())


def cannot_tell(file: str, line: int | None, command: str, why: str, *also: str) -> None:
    """RF201 for a command whose tests check-tests cannot tell, unless a shard of ci-shards.yaml
    says it describes that command (`for:`)."""
    if any(spoken(c) in DESCRIBED for c in (command, *also)):
        return
    raise RlflowError(
        Diagnostic(
            "RF201",
            f"cannot tell which tests `{command.strip()[:120]}` runs: {why}",
            file=file,
            line=line,
            help=f"spell the test paths out, or describe what it runs in {SHARDS_FILE} "
            f"(a shard with `for: {json.dumps(command.strip()[:120])}`; docs/lockstep.md: "
            "check-tests)",
        )
    )


def bad(file: str, line: int | None, reason: str, help: str | None = None) -> RlflowError:
    return RlflowError(
        Diagnostic("RF200", f"malformed `{file}`: {reason}", file=file, line=line, help=help)
    )


CI_FILE_MAX_BYTES = 16 << 20  # no CI file is near this; a link to a log or /dev/zero would be


def read_bytes(path: Path, rel: str) -> bytes:
    """A CI file's bytes, read within bounds (rlflow/bounded.py); a FIFO, a device or a file
    over CI_FILE_MAX_BYTES -> RF200 naming it. A missing file raises FileNotFoundError."""
    import os

    from rlflow import bounded

    try:
        return bounded.read_bytes(path, CI_FILE_MAX_BYTES)
    except FileNotFoundError:
        if not os.path.islink(path):
            raise
        reason = f"it links to {os.readlink(path)}, which does not exist"
    except OSError as err:  # UnreadableFile, a symbolic link loop, no permission
        reason = str(err) if isinstance(err, bounded.UnreadableFile) else err.strerror or str(err)
    raise bad(
        rel,
        None,
        f"cannot be read: {reason}",
        "CI reads it too: put the file itself there (a regular file)",
    )


def read_text(root: Path, rel: str) -> str:
    """The file as UTF-8; invalid bytes -> RF200 naming the line."""
    data = read_bytes(root / rel, rel)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise bad(
            rel,
            line,
            f"not UTF-8 ({err.reason} at byte {err.start})",
            "save it as UTF-8 (GitHub rejects it too)",
        ) from None


def line_of(lines: list[str], command: str) -> int | None:
    head = command.split("\\")[0].strip()[:60]
    for number, line in enumerate(lines, start=1):
        if head and head in line:
            return number
    return None


# -- ci-shards.yaml ---------------------------------------------------------------------------
def yaml_shards(root: Path, rel: str) -> list[Shard]:
    import shlex

    import yaml

    text = read_text(root, rel)
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise _bad_yaml(rel, mark.line + 1 if mark else None, str(err).splitlines()[0]) from None
    entries = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise _bad_yaml(rel, 1, "expected a top-level `shards:` list")
    lines = text.split("\n")
    shards = []
    for i, entry in enumerate(entries):
        name = entry.get("name") if isinstance(entry, dict) else None
        line = line_of(lines, f"name: {name}") if name else None
        if not isinstance(entry, dict) or not isinstance(name, str):
            raise _bad_yaml(rel, line, f"shard {i + 1} needs a `name` (a string)")
        args = entry.get("args", [])
        if isinstance(args, str):
            try:
                args = shlex.split(args)
            except ValueError as err:
                raise _bad_yaml(rel, line, f"shard `{name}`: `args` {err}") from None
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise _bad_yaml(
                rel, line, f"shard `{name}`: `args` must be a string or a list of strings"
            )
        cwd = entry.get("working-directory", "")
        if not isinstance(cwd, str):
            raise _bad_yaml(rel, line, f"shard `{name}`: `working-directory` must be a string")
        describes = entry.get("for", [])
        describes = [describes] if isinstance(describes, str) else describes
        if not isinstance(describes, list) or not all(isinstance(d, str) for d in describes):
            raise _bad_yaml(
                rel, line, f"shard `{name}`: `for` must be a CI command (a string) or a list"
            )
        shards.append(
            Shard(
                f"{rel}:{line} ({name})",
                rel,
                line,
                tuple(args),
                cwd.strip("/"),
                describes=tuple(describes),
            )
        )
    return shards


def _bad_yaml(rel: str, line: int | None, reason: str) -> RlflowError:
    fix = 'write `shards: [{name: unit, args: ["tests/unit", "-m", "not gpu"]}]`'
    return file_error("RF200", f"malformed `{rel}`: {reason}", rel, line, fix)
