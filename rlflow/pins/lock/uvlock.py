"""Read a uv.lock fast: the header and the local packages whole, every other package's name,
version and source from its first lines.

uv writes its lock in one canonical layout (`[[package]]` blocks that start with `name`,
`version`, `source`), so a lock of 550 packages is split on its block headers and tomllib
(pure Python, ~0.3 s for the 900 kB NeMo-RL lock) parses only the header and the few blocks that
describe local projects, and of those only their `[package.metadata]` tables, which are what
`uv lock --check` compares (tables.py reads those tables in uv's own layout faster, with
tomllib's result). `full=True` parses every block whole (the dependency edges `deployed-locks`
needs). A block that does not look like uv wrote it falls back to parsing the whole file.
"""

from __future__ import annotations

import os
import re
import tomllib
from urllib.parse import parse_qs, urlsplit

from rlflow.errors import RlflowError, file_error
from rlflow.pins import markers
from rlflow.pins.lock import tables as locktables
from rlflow.pins.lock.lowering import index_url, lock_repo, spec_key
from rlflow.pins.pep508 import canonicalize_name
from rlflow.pins.records import factory, record

LOCAL_KINDS = ("editable", "directory", "virtual")
_BLOCK = "\n[[package]]\n"
_HEAD = re.compile(
    r'name = "(?P<name>[^"]*)"\n(?:version = "(?P<version>[^"]*)"\n)?source = \{ (?P<source>[^\n]*) \}\n'
)
_PAIR = re.compile(r'([A-Za-z-]+) = "((?:[^"\\]|\\.)*)"')


@record(frozen=False)
class Package:
    name: str
    version: str | None
    source: dict[str, str]
    line: int
    data: dict | None = None  # full=True: the whole block; local packages: their metadata

    @property
    def local_kind(self) -> str | None:
        return next((k for k in LOCAL_KINDS if k in self.source), None)


@record(frozen=False)
class UvLock:
    file: str  # relative to the repository root
    directory: str  # absolute
    header: dict
    packages: list[Package] = factory(list)

    @property
    def manifest(self) -> dict:
        value = self.header.get("manifest")
        return value if isinstance(value, dict) else {}

    @property
    def requires_python(self) -> str | None:
        value = self.header.get("requires-python")
        return value if isinstance(value, str) else None

    def local(self) -> list[Package]:
        return [p for p in self.packages if p.local_kind]

    def path_of(self, package: Package) -> str:
        return os.path.normpath(os.path.join(self.directory, package.source[package.local_kind]))


LOCK_MAX_BYTES = 256 << 20  # NeMo-RL's lock is 0.9 MB; more is no lock (rlflow/bounded.py)


def read(root, rel: str, full: bool = False) -> UvLock | None:
    """The lock at `rel`; None where there is none. Anything else there (a directory, a FIFO, a
    link to a device or to nothing) is RF102, as `uv lock --check` fails on it (exit 2)."""
    from rlflow import bounded

    path = root / rel
    if not os.path.lexists(path):
        return None
    try:
        data = bounded.read_bytes(path, LOCK_MAX_BYTES)
        text = data.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n")
    except FileNotFoundError:
        why = f"it links to {os.readlink(path)}, which does not exist"
        raise _unreadable(rel, None, why) from None
    except (OSError, UnicodeDecodeError) as err:
        raise _unreadable(rel, None, str(err)) from None
    directory = str(path.parent.resolve())
    try:
        return _split(rel, directory, text, full)
    except (tomllib.TOMLDecodeError, ValueError, KeyError, RecursionError):
        return _whole(rel, directory, text)


def _split(rel: str, directory: str, text: str, full: bool) -> UvLock:
    chunks = text.split(_BLOCK)
    lock = UvLock(rel, directory, tomllib.loads(chunks[0]))
    line = chunks[0].count("\n") + 2
    for chunk in chunks[1:]:
        match = _HEAD.match(chunk)
        if match is None:
            raise ValueError("not uv's layout")
        source = dict(_PAIR.findall(match.group("source")))
        package = Package(
            canonicalize_name(match.group("name")), match.group("version"), source, line + 2
        )
        if full or package.local_kind:
            tables = _without_artifacts(chunk if full else _metadata_tables(chunk))
            data = None if full else locktables.read(tables)  # tomllib's result, faster
            data = tomllib.loads(tables) if data is None else data
            tables = data.pop("package", {})  # `[package.metadata]` etc. inside the block
            package.data = {**data, **(tables if isinstance(tables, dict) else {})}
            if not full:
                package.data.update(_head_keys(chunk))
        lock.packages.append(package)
        line += chunk.count("\n") + 2
    return lock


def _whole(rel: str, directory: str, text: str) -> UvLock:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        from rlflow.pins.parse import _toml_error

        raise _toml_error(rel, text, err) from None
    except RecursionError as err:
        raise _unreadable(rel, None, str(err)) from None
    header = {k: v for k, v in data.items() if k != "package"}
    lock = UvLock(rel, directory, header)
    lines = {
        m.group(1): text.count("\n", 0, m.start()) + 1
        for m in re.finditer(r'(?m)^name = "([^"]*)"', text)
    }
    for entry in data.get("package", []) if isinstance(data.get("package"), list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        source = entry.get("source") if isinstance(entry.get("source"), dict) else {}
        lock.packages.append(
            Package(
                canonicalize_name(entry["name"]),
                entry.get("version") if isinstance(entry.get("version"), str) else None,
                {k: str(v) for k, v in source.items()},
                lines.get(entry["name"], 1),
                entry,
            )
        )
    return lock


_HEAD_KEYS = re.compile(r"^default-groups = [^\n]*$", re.M)


def _head_keys(chunk: str) -> dict:
    """The keys of a local package's head that `uv lock --check` compares beyond its metadata:
    `default-groups` (written on one line: `"all"` or a short list)."""
    head = chunk.split("\n[", 1)[0]
    found = _HEAD_KEYS.search(head)
    return tomllib.loads(found.group(0)) if found else {}


def _metadata_tables(chunk: str) -> str:
    """A local package's `[package.metadata...]` tables, which uv writes last in its block:
    what `uv lock --check` compares (its dependency edges are only read with full=True)."""
    at = chunk.find("\n[package.metadata")
    return chunk[at + 1 :] if at >= 0 else ""


def _without_artifacts(chunk: str) -> str:
    out, skipping = [], False
    for line in chunk.split("\n"):
        if skipping:
            skipping = line != "]"
            continue
        if line.startswith("sdist = {") and line.endswith("}"):
            continue
        if line.startswith("wheels = ["):
            skipping = not line.endswith("]")
            continue
        out.append(line)
    return "\n".join(out)


def _unreadable(rel: str, line: int | None, reason: str) -> RlflowError:
    return file_error(
        "RF102", f"cannot read `{rel}`: {reason}", rel, line, "re-create it with `uv lock`"
    )


# -- lock entries in lowering's terms ---------------------------------------------------------
def entry(item, directory: str) -> tuple:
    """A `{ name = ..., specifier = ..., git = ... }` of requires-dist -> an Entry."""
    if not isinstance(item, dict):
        return ("?", (), ("?",), markers.TRUE)
    name = canonicalize_name(str(item.get("name", "?")))
    extras = tuple(sorted(canonicalize_name(str(e)) for e in item.get("extras", []) or []))
    try:
        marker = markers.parse(item.get("marker"))
    except ValueError:
        marker = ("raw", str(item.get("marker")))
    return (name, extras, source_of(item, directory), marker)


def source_of(item: dict, directory: str) -> tuple:
    if "git" in item:
        parts = urlsplit(str(item["git"]))
        query = parse_qs(parts.query)
        kind = next((k for k in ("rev", "tag", "branch") if k in query), None)
        return (
            "git",
            lock_repo(parts._replace(query="", fragment="").geturl()),
            kind,
            query[kind][0] if kind else None,
            item.get("subdirectory") or query.get("subdirectory", [None])[0],
            "true"
            in (query.get("lfs", [""])[0] + parse_qs(parts.fragment).get("lfs", [""])[0]).lower(),
        )
    if "url" in item:
        return ("url", str(item["url"]).partition("#")[0], item.get("subdirectory"))
    for kind in ("editable", "directory", "path", "virtual"):
        if kind in item:
            return ("path", kind, os.path.normpath(os.path.join(directory, str(item[kind]))))
    index = item.get("index")
    return (
        "registry",
        spec_key(str(item.get("specifier", ""))),
        index_url(index) if index else None,
    )


def unconfigured_registry(lock: UvLock, projects: list) -> Package | None:
    """A locked package whose registry (index URL or find-links directory) no project names
    now; None when none is, or when no project configures any index (uv checks nothing then)."""
    remote, local, configured, pypi = set(), set(), False, True
    for project in projects:
        uv = project.uv
        for item in uv.get("index", []) if isinstance(uv.get("index"), list) else []:
            if isinstance(item, dict) and isinstance(item.get("url"), str):
                configured = True
                _add_location(item["url"], project.directory, remote, local, lock.directory)
                pypi = pypi and not item.get("default")
        for key in ("index-url", "extra-index-url", "find-links"):
            values = uv.get(key)
            for value in [values] if isinstance(values, str) else values or []:
                configured = True
                _add_location(str(value), project.directory, remote, local, lock.directory)
                pypi = pypi and key != "index-url"
        if uv.get("no-index"):
            configured, pypi = True, False
    if not configured:
        return None
    if pypi:
        remote.add("https://pypi.org/simple")
    for package in lock.local():  # indexes the validated local projects ask for count too
        metadata = (package.data or {}).get("metadata", {})
        items = metadata.get("requires-dist", []) if isinstance(metadata, dict) else []
        for item in items or []:
            if isinstance(item, dict) and isinstance(item.get("index"), str):
                _add_location(item["index"], lock.directory, remote, local, lock.directory)
    for package in lock.packages:
        value = package.source.get("registry")
        if value is None:
            continue
        if _remote(value):
            where = index_url(value)
        else:
            where = _written(value.removeprefix("file://"), lock.directory, lock.directory)
        if where not in remote and where not in local:
            return package
    return None


def _remote(value: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*://", value)) and not value.startswith("file://")


def _written(path: str, directory: str, lock_directory: str) -> str:
    """A local index as uv writes it in the lock: a relative path stays relative (to the lock's
    directory, normalized), an absolute one (or a file:// URL) absolute. uv 0.13 compares that
    form: configuring `../wheels` where the lock says `/abs/wheels` makes it stale."""
    if os.path.isabs(path):
        return os.path.normpath(path)
    return os.path.normpath(os.path.relpath(os.path.join(directory, path), lock_directory))


def _add_location(value: str, directory: str, remote: set, local: set, lock_dir: str) -> None:
    if _remote(value):
        remote.add(index_url(value))
    else:
        local.add(_written(value.removeprefix("file://"), directory, lock_dir))
