"""Lock-level checks: uv.lock files of the root and of submodules; offline, no resolver.

    RF010 error  a package locked by the root and by a submodule comes from different sources
                 (git URL + commit, registry URL, or path), e.g. Megatron-Bridge locks another
                 TransformerEngine commit than the root does
    RF011 error  the root's uv.lock is stale against its pyproject.toml (`uv lock --check`
                 would fail): a requirement, constraint, override, group or requires-python
                 changed, here or in a path dependency (a submodule's own stale lock: warning)

RF011 follows uv's own test: uv records every requirement as the project declared it (after
`[tool.uv.sources]`) under `[package.metadata]` and `[manifest]`, and a lock is fresh when that
record equals what the pyproject asks for now. We compare name, specifier, extras and source;
markers are left out (uv rewrites them, `python_version` -> `python_full_version`), so a change of
marker alone is not reported: no false alarms, and uv has the last word.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name

from rlflow.errors import Diagnostic, RlflowError
from rlflow.pins.model import Finding, Location
from rlflow.pins.urls import normalize_repo

LOCK = "uv.lock"


@dataclass(frozen=True)
class Lock:
    project: str  # directory relative to the repository root ("" = root)
    file: str  # relative path of the uv.lock
    directory: str  # absolute directory of the lock
    data: dict
    lines: dict[str, int]  # package name -> line of its `source =` (first entry)
    metadata_line: int | None  # line of the project's own [package.metadata]


def lock_findings(root: Path, manifests: list, documents: list) -> list[Finding]:
    """RF010 and RF011 for every project that has a uv.lock next to its pyproject.toml."""
    locks = [lock for m in manifests if (lock := read_lock(root, m.project)) is not None]
    if not locks:
        return []
    findings: list[Finding] = []
    by_project = {m.project: (m, d) for m, d in zip(manifests, documents, strict=True)}
    for lock in locks:
        manifest, document = by_project[lock.project]
        finding = stale(lock, manifest, document)
        if finding is None:  # uv also re-reads the path dependencies it locked
            finding = stale_path_dependency(lock, list(by_project.values()))
        if finding is not None:
            findings.append(finding)
    root_lock = next((lock for lock in locks if lock.project == ""), None)
    if root_lock is not None:
        for lock in locks:
            if lock is not root_lock:
                findings += source_mismatches(root_lock, lock)
    return findings


def read_lock(root: Path, project: str) -> Lock | None:
    rel = f"{project}/{LOCK}" if project else LOCK
    path = root / rel
    if not path.exists():
        return None
    try:
        text = path.read_bytes().decode("utf-8").removeprefix("\ufeff")
        try:
            data = tomllib.loads(_without_artifacts(text))
        except tomllib.TOMLDecodeError:
            data = tomllib.loads(text)  # the full text, for the exact error and line
    except tomllib.TOMLDecodeError as err:
        from rlflow.pins.parse import _toml_error

        raise _toml_error(rel, text, err) from None
    except (OSError, UnicodeDecodeError, RecursionError) as err:
        raise RlflowError(
            Diagnostic(
                "RF102",
                f"cannot read `{rel}`: {err}",
                file=rel,
                help="re-create it with `uv lock`",
            )
        ) from None
    lines, metadata_line, name = {}, None, None
    for number, line in enumerate(text.split("\n"), start=1):
        if line.startswith("name = "):
            name = canonicalize_name(line.split('"')[1]) if '"' in line else None
        elif line.startswith("source = ") and name and name not in lines:
            lines[name] = number
            if re.search(r'(editable|virtual|directory) = "\."', line):
                metadata_line = number
    return Lock(project, rel, str(path.parent), data, lines, metadata_line)


def _without_artifacts(text: str) -> str:
    """The lock minus its `sdist = {...}` and `wheels = [...]` entries: most of its bytes
    (URLs, hashes, sizes), none of what is compared here. tomllib is pure Python: parsing a
    400 kB lock whole takes ~0.1 s; without them, a fifth of that."""
    out, skipping = [], False
    for line in text.split("\n"):
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


# -- RF010: shared packages, one source --------------------------------------------------------
def sources_by_package(lock: Lock) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for package in lock.data.get("package", []):
        if isinstance(package, dict) and isinstance(package.get("name"), str):
            source = package.get("source")
            out[canonicalize_name(package["name"])].add(_source_key(source, lock.directory))
    return out


def _source_key(source, base: str) -> str:
    if not isinstance(source, dict):
        return "unknown"
    if "git" in source:
        url = str(source["git"])
        base_url, _, commit = url.partition("#")
        parts = urlsplit(base_url)
        subdirectory = parse_qs(parts.query).get("subdirectory", [""])[0]
        repo = normalize_repo(parts._replace(query="").geturl())
        return f"git {repo}{'#' + subdirectory if subdirectory else ''} @ {commit or '?'}"
    for key in ("registry", "url"):
        if key in source:
            return f"{key} {source[key]}"
    for key in ("editable", "directory", "path", "virtual"):
        if key in source:
            return f"path {os.path.normpath(os.path.join(base, str(source[key])))}"
    return "unknown"


def source_mismatches(root_lock: Lock, sub_lock: Lock) -> list[Finding]:
    ours, theirs = sources_by_package(root_lock), sources_by_package(sub_lock)
    findings = []
    for name in sorted(set(ours) & set(theirs)):
        if ours[name] != theirs[name]:
            findings.append(
                Finding(
                    "RF010",
                    "error",
                    package=name,
                    location=Location(root_lock.file, root_lock.lines.get(name)),
                    detail=(
                        f"`{name}` is locked from {_show(ours[name])} in `{root_lock.file}` but "
                        f"from {_show(theirs[name])} in `{sub_lock.file}`"
                        f" (line {sub_lock.lines.get(name)})"
                    ),
                )
            )
    return findings


def _show(keys: set[str]) -> str:
    return " and ".join(f"`{k}`" for k in sorted(keys))


# -- RF011: stale lock -------------------------------------------------------------------------
Entry = tuple[str, tuple[str, ...], str, str]  # name, extras, specifier, source


def stale(lock: Lock, manifest, document) -> Finding | None:
    """A Finding when the lock's record of the project differs from its pyproject now."""
    data = document.data
    project = data.get("project") if isinstance(data.get("project"), dict) else {}
    if "dependencies" in project.get("dynamic", []) or not manifest.name:
        return None  # computed at build time: only uv can tell
    recorded = _recorded(lock, manifest.name)
    if recorded is None:
        return _finding(lock, f"`{lock.file}` does not lock project `{manifest.name}`", None)
    wanted = _wanted(data, manifest.directory)
    for what in ("requires-dist", "requires-dev", "constraints", "overrides"):
        have, want = Counter(recorded[what]), Counter(wanted[what])
        if have != want:
            added = sorted((want - have).elements())
            removed = sorted((have - want).elements())
            detail = _difference(what, added, removed)
            where = _pyproject_line(document, added[0][0]) if added else None
            return _finding(lock, detail, where)
    lock_python = lock.data.get("requires-python")
    project_python = project.get("requires-python")
    if isinstance(lock_python, str) and isinstance(project_python, str):
        if _spec(lock_python) != _spec(project_python) and not _workspace(lock):
            return _finding(
                lock,
                f"requires-python is `{project_python}` but the lock has `{lock_python}`",
                document.loc(("project", "requires-python")),
            )
    return None


def stale_path_dependency(lock: Lock, projects: list) -> Finding | None:
    """A path dependency (a submodule) whose requirements changed since the lock recorded them."""
    by_directory = {m.directory: (m, d) for m, d in projects}
    for package in lock.data.get("package", []):
        if not isinstance(package, dict) or not isinstance(package.get("source"), dict):
            continue
        key = _source_key(package["source"], lock.directory)
        if not key.startswith("path ") or key[5:] == lock.directory:
            continue
        found = by_directory.get(key[5:])
        metadata = package.get("metadata")
        if found is None or not isinstance(metadata, dict):
            continue
        manifest, document = found
        project = document.data.get("project")
        if not isinstance(project, dict) or "dependencies" in project.get("dynamic", []):
            continue
        have = Counter(_lock_entry(e, lock.directory) for e in metadata.get("requires-dist", []))
        want = Counter(_wanted(document.data, manifest.directory)["requires-dist"])
        if have != want:
            added, removed = sorted((want - have).elements()), sorted((have - want).elements())
            detail = f"path dependency `{manifest.project}`: " + _difference(
                "requires-dist", added, removed
            )
            where = _pyproject_line(document, added[0][0]) if added else None
            return _finding(lock, detail, where)
    return None


def _workspace(lock: Lock) -> bool:
    manifest = lock.data.get("manifest", {})
    return isinstance(manifest, dict) and len(manifest.get("members", [])) > 1


def _recorded(lock: Lock, name: str) -> dict[str, list[Entry]] | None:
    own = None
    for package in lock.data.get("package", []):
        if not isinstance(package, dict) or not isinstance(package.get("name"), str):
            continue
        source = package.get("source", {})
        if canonicalize_name(package["name"]) == name and isinstance(source, dict):
            if any(source.get(k) == "." for k in ("editable", "virtual", "directory")):
                own = package
    if own is None:
        return None
    metadata = own.get("metadata", {}) if isinstance(own.get("metadata"), dict) else {}
    manifest = lock.data.get("manifest", {}) if isinstance(lock.data.get("manifest"), dict) else {}
    dev = metadata.get("requires-dev", {})
    return {
        "requires-dist": [
            _lock_entry(e, lock.directory) for e in metadata.get("requires-dist", [])
        ],
        "requires-dev": [
            (group, *_lock_entry(e, lock.directory)[:4])
            for group, entries in (dev.items() if isinstance(dev, dict) else [])
            for e in entries
        ],
        "constraints": [_lock_entry(e, lock.directory) for e in manifest.get("constraints", [])],
        "overrides": [_lock_entry(e, lock.directory) for e in manifest.get("overrides", [])],
    }


def _lock_entry(entry, base: str) -> Entry:
    if not isinstance(entry, dict):
        return ("?", (), "", "")
    name = canonicalize_name(str(entry.get("name", "?")))
    extras = tuple(sorted(canonicalize_name(e) for e in entry.get("extras", [])))
    source = ""
    if "git" in entry:
        url = urlsplit(str(entry["git"]))
        query = parse_qs(url.query)
        ref = next((f"{k}={query[k][0]}" for k in ("rev", "tag", "branch") if k in query), "")
        sub = query.get("subdirectory", [""])[0]
        source = f"git {normalize_repo(url._replace(query='').geturl())}@{ref}#{sub}"
    elif "url" in entry:
        source = f"url {entry['url']}"
    else:
        for key in ("editable", "directory", "path"):
            if key in entry:
                source = f"path {os.path.normpath(os.path.join(base, str(entry[key])))}"
                break
    specifier = "" if source else _spec(str(entry.get("specifier", "")))
    return (name, extras, specifier, source)


def _wanted(data: dict, directory: str) -> dict[str, list[Entry]]:
    """What the pyproject asks for, in the lock's terms (sources applied like uv does)."""
    from packaging.requirements import InvalidRequirement, Requirement

    tool_uv = data.get("tool", {}).get("uv", {}) if isinstance(data.get("tool"), dict) else {}
    sources = tool_uv.get("sources", {}) if isinstance(tool_uv, dict) else {}
    sources = (
        {canonicalize_name(k): v for k, v in sources.items()} if isinstance(sources, dict) else {}
    )

    def entries(items, use_sources: bool = True) -> list[Entry]:
        out = []
        for text in items if isinstance(items, list) else []:
            if not isinstance(text, str):
                continue
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue  # parse.py already reported it
            name = canonicalize_name(req.name)
            extras = tuple(sorted(canonicalize_name(e) for e in req.extras))
            source = _source_of(req, sources.get(name) if use_sources else None, directory)
            out.append((name, extras, "" if source else _spec(str(req.specifier)), source))
        return out

    project = data.get("project", {}) if isinstance(data.get("project"), dict) else {}
    dist = entries(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for items in optional.values() if isinstance(optional, dict) else []:
        dist += entries(items)
    groups = data.get("dependency-groups", {})
    dev: list = []
    for group, items in groups.items() if isinstance(groups, dict) else []:
        dev += [(canonicalize_name(group), *e) for e in entries(items)]
    dev += [("dev", *e) for e in entries(tool_uv.get("dev-dependencies", []))]
    return {
        "requires-dist": dist,
        "requires-dev": dev,
        "constraints": entries(tool_uv.get("constraint-dependencies", [])),
        "overrides": entries(tool_uv.get("override-dependencies", [])),
    }


def _source_of(req, source, directory: str) -> str:
    if isinstance(source, list):
        source = source[0] if len(source) == 1 and isinstance(source[0], dict) else None
    if isinstance(source, dict) and "index" not in source and "workspace" not in source:
        if "git" in source:
            ref = next((f"{k}={source[k]}" for k in ("rev", "tag", "branch") if k in source), "")
            repo = normalize_repo(str(source["git"]))
            return f"git {repo}@{ref}#{source.get('subdirectory', '')}"
        if "url" in source:
            return f"url {source['url']}"
        if "path" in source:
            return f"path {os.path.normpath(os.path.join(directory, str(source['path'])))}"
    if req.url:
        url = req.url
        if url.startswith("git+"):
            base, _, fragment = url[4:].partition("#")
            parts = urlsplit(base)
            path, ref = parts.path, ""
            if "@" in path:
                path, ref = path.rsplit("@", 1)
                ref = f"rev={ref}"  # uv records a URL's @ref as `?rev=`
            sub = parse_qs(fragment).get("subdirectory", [""])[0]
            return f"git {normalize_repo(parts._replace(path=path).geturl())}@{ref}#{sub}"
        if url.startswith("file://"):
            return f"path {os.path.normpath(urlsplit(url).path)}"
        return f"url {url}"
    return ""


def _spec(text: str) -> str:
    try:
        return ",".join(sorted(str(s) for s in SpecifierSet(text)))
    except InvalidSpecifier:
        return text


def _difference(what: str, added: list, removed: list) -> str:
    def show(entry) -> str:
        *group, name, extras, spec, source = entry
        extra = f"[{','.join(extras)}]" if extras else ""
        where = f" from {source}" if source else ""
        prefix = f"{group[0]}: " if group else ""
        return f"`{prefix}{name}{extra}{spec}{where}`"

    parts = []
    if added:
        parts.append("not locked: " + ", ".join(show(e) for e in added[:3]))
    if removed:
        parts.append("locked but no longer asked for: " + ", ".join(show(e) for e in removed[:3]))
    return f"{what} changed since the lock was written ({'; '.join(parts)})"


def _pyproject_line(document, name: str) -> Location | None:
    pattern = re.compile(
        r"[\"']\s*" + "[-_.]?".join(re.escape(p) for p in re.split(r"[-_.]", name)), re.I
    )
    for number, line in enumerate(document.lines.lines, start=1):
        if pattern.search(line):
            return Location(document.file, number)
    return None


def _finding(lock: Lock, detail: str, where: Location | None) -> Finding:
    # A submodule's stale lock is upstream's to fix and breaks nothing the root locks: a warning
    # (`--strict` makes it an error). The root's own stale lock is an error.
    return Finding(
        "RF011",
        "error" if lock.project == "" else "warning",
        location=where or Location(lock.file, lock.metadata_line),
        detail=f"`{lock.file}` is stale: {detail}",
    )
