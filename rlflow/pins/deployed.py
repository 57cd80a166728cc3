"""RF010: a submodule that `deployed-locks` says is deployed from its own uv.lock must lock the
packages the root installs through it from the same git commit, URL or path as the root's lock.

Registry packages are never compared: their versions drift between two locks as a matter of
course, and the same release from PyPI or NVIDIA's index is one release. Where the root
decides (its override-dependencies, its index choices in [tool.uv.sources]) it wins by design.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from rlflow.pins.lock import uvlock
from rlflow.pins.model import Finding, Location
from rlflow.pins.pep508 import canonicalize_name
from rlflow.pins.urls import normalize_repo


def _texts(value) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def agreement(
    root_lock: uvlock.UvLock, sub_lock: uvlock.UvLock, root: Path, root_doc
) -> list[Finding]:
    sub_dir = sub_lock.directory
    start = [p for p in root_lock.packages if p.local_kind and root_lock.path_of(p) == sub_dir]
    if not start:
        return []
    reached = _closure(root_lock, start)
    decided = _root_decisions(root_doc.data if root_doc is not None else {})
    ours = _sources(root_lock, reached)
    theirs = _sources(sub_lock, None)
    findings = []
    for name in sorted(set(ours) & set(theirs)):
        if name in decided or ours[name] & theirs[name]:
            continue
        findings.append(
            Finding(
                "RF010",
                "error",
                package=name,
                location=Location(
                    root_lock.file, next(p.line for p in root_lock.packages if p.name == name)
                ),
                detail=(
                    f"`{name}` is locked as {_show(ours[name])} in `{root_lock.file}` but as "
                    f"{_show(theirs[name])} in `{sub_lock.file}`, which [tool.rlflow.pins] "
                    "deployed-locks says is deployed on its own"
                ),
            )
        )
    return findings


def _closure(lock: uvlock.UvLock, start: list) -> set[str]:
    by_name: dict[str, list] = {}
    for package in lock.packages:
        by_name.setdefault(package.name, []).append(package)
    seen, queue = set(), list(start)
    while queue:
        package = queue.pop()
        if package.name in seen:
            continue
        seen.add(package.name)
        data = package.data or {}
        edges = list(data.get("dependencies", []) or [])
        for items in (data.get("optional-dependencies", {}) or {}).values():
            edges += items or []
        for edge in edges:
            if isinstance(edge, dict) and isinstance(edge.get("name"), str):
                queue += by_name.get(canonicalize_name(edge["name"]), [])
    return seen


def _root_decisions(data: dict) -> set[str]:
    tool = data.get("tool", {}) if isinstance(data.get("tool"), dict) else {}
    uv = tool.get("uv", {}) if isinstance(tool.get("uv"), dict) else {}
    names = set()
    sources = uv.get("sources") if isinstance(uv.get("sources"), dict) else {}
    for name, value in sources.items():  # an index choice: torch from the PyTorch index
        items = value if isinstance(value, list) else [value]
        if any(isinstance(i, dict) and "index" in i for i in items):
            names.add(canonicalize_name(name))
    from packaging.requirements import InvalidRequirement, Requirement

    for text in _texts(uv.get("override-dependencies")):  # the root's override wins everywhere
        try:
            names.add(canonicalize_name(Requirement(text).name))
        except InvalidRequirement:
            continue
    return names


def _sources(lock: uvlock.UvLock, only: set[str] | None) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for package in lock.packages:
        if only is not None and package.name not in only:
            continue
        if package.local_kind:
            continue
        out.setdefault(package.name, set()).add(_locked_as(package, lock.directory))
    return out


def _locked_as(package, directory: str) -> str:
    source = package.source
    if "registry" in source:
        # A registry's version is ordinary drift between two locks, and the same release on
        # PyPI and on NVIDIA's index is one release: only pinned sources are compared.
        return "a registry release"
    if "git" in source:
        parts = urlsplit_git(source["git"])
        return f"git {parts}"
    if "url" in source:
        return f"url {source['url']}"
    kind = next(iter(source), "?")
    return f"path {os.path.normpath(os.path.join(directory, source.get(kind, '')))}"


def urlsplit_git(url: str) -> str:
    base, _, commit = url.partition("#")
    parts = urlsplit(base)
    sub = parse_qs(parts.query).get("subdirectory", [""])[0]
    return f"{normalize_repo(parts._replace(query='').geturl())}{'#' + sub if sub else ''} @ {commit or '?'}"


def _show(keys: set[str]) -> str:
    return " and ".join(f"`{k}`" for k in sorted(keys))
