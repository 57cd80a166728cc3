"""uv's staleness test, part two: the record of each local project in a uv.lock. Every workspace
member and every path dependency uv reads must be locked as what its pyproject.toml asks for now,
after lowering (lowering.py): version, virtual or not, provides-extras, requires-dist,
dependency groups (requires-dev) and, from lock revision 5, `default-groups`. Each check returns
a `Stale` (words.py) or None, or raises `Undecidable`; level.py runs them after the
settings of settings.py.
"""

from __future__ import annotations

import functools
import os

from rlflow.pins import workspace
from rlflow.pins.lock import lowering, uvlock
from rlflow.pins.lock.words import Stale, difference, first_stale, line, rel, shown
from rlflow.pins.pep508 import canonicalize_name
from rlflow.pins.workspace import Undecidable


def packages(lock, root, members, python) -> Stale | None:
    """Every local project in the lock: workspace members and the path dependencies uv reads."""
    by_dir = {m.directory: m for m in members.values()}
    local = lock.local()
    for name, member in members.items():
        package = next((p for p in local if p.name == name), None)
        if package is None:
            return Stale(f"the lock has no entry for project `{name}`", line(root, "name"))
        virtual = _virtual(member)
        if virtual is not None and virtual != (package.local_kind == "virtual"):
            now = "virtual (not built)" if virtual else "a package"
            return Stale(f"`{name}` is now {now}; the lock has it {package.local_kind}")
    return first_stale(
        functools.partial(_local, lock, package, by_dir, members, python, root) for package in local
    )


def _local(lock, package, by_dir, members, python, root) -> Stale | None:
    directory = lock.path_of(package)
    project = by_dir.get(directory)
    if project is None:
        if not os.path.isdir(directory):
            raise Undecidable(
                f"local project `{package.name}` at `{directory}` is not there (a submodule not checked out?)"
            )
        project = workspace.load_project(directory)
        project.no_sources = root.no_sources
    found = _package(lock, package, project, python, root)
    if found or not (project in members.values() and _revision(lock) >= 5):
        return found
    return _default_groups(package, project)


def _revision(lock) -> int:
    revision = lock.header.get("revision", 0)
    return revision if isinstance(revision, int) else 0


def _default_groups(package, project) -> Stale | None:
    """uv records a member's `[tool.uv] default-groups` in its lock entry ("all", or the sorted
    list; nothing when unset or `["dev"]`, uv's default), and a change makes the lock stale: from
    lock revision 5 on
    (measured with uv 0.13.9: a revision 4 lock without it is fresh; NeMo-RL's is revision 3)."""

    def form(value):
        if isinstance(value, list):
            value = sorted({canonicalize_name(str(g)) for g in value})
        return None if value == ["dev"] else value  # uv's default: not recorded

    want = form(project.uv.get("default-groups"))
    have = form((package.data or {}).get("default-groups"))
    if want != have:
        return Stale(
            f"`{package.name}`: [tool.uv] default-groups is {shown(want)}, the lock has "
            f"{shown(have)}",
            line(project, "default-groups"),
        )
    return None


def _virtual(member) -> bool | None:
    """True/False when uv must record the member as virtual or not; None when that depends on
    who requires it (no build-system and no `tool.uv.package`)."""
    package = member.uv.get("package")
    if isinstance(package, bool):
        return not package
    return False if isinstance(member.data.get("build-system"), dict) else None


def _package(lock, package, project, python, root) -> Stale | None:
    data = package.data or {}
    metadata = data.get("metadata", {}) if isinstance(data.get("metadata"), dict) else {}
    wanted = lowering.record(project)
    label = f"`{package.name}`" + (
        " (the root project)" if project is root else f" (`{rel(lock, project.directory)}`)"
    )
    if package.local_kind != "virtual":
        if wanted.version is None and package.version is not None:
            return Stale(f"{label} now has a dynamic version; the lock records {package.version}")
        if wanted.version is not None and not lowering.same_version(
            package.version, wanted.version
        ):
            return Stale(
                f"{label} is version {wanted.version}, the lock has {package.version}",
                line(project, "version"),
            )
    have_extras = frozenset(
        canonicalize_name(str(e)) for e in metadata.get("provides-extras", []) or []
    )
    if "provides-extras" in metadata or wanted.provides_extras:
        if have_extras != wanted.provides_extras:
            gone = sorted(have_extras - wanted.provides_extras)
            new = sorted(wanted.provides_extras - have_extras)
            return Stale(
                f"{label}: extras changed (new: {new or 'none'}; gone: {gone or 'none'})",
                line(project, "optional-dependencies"),
            )
    have = [uvlock.entry(i, lock.directory) for i in metadata.get("requires-dist", []) or []]
    diff = lowering.compare_entries(have, wanted.requires_dist, python)
    if diff:
        return Stale(
            f"{label}: " + difference("requires-dist", *diff), line(project, "dependencies", diff)
        )
    dev = metadata.get("requires-dev", {}) if isinstance(metadata.get("requires-dev"), dict) else {}
    return groups(label, dev, wanted.requires_dev, lock, python, project)


def groups(label, have_raw: dict, want: dict, lock, python, project) -> Stale | None:
    have = {
        canonicalize_name(g): [uvlock.entry(i, lock.directory) for i in items or []]
        for g, items in have_raw.items()
    }
    # uv-resolver `Lock::includes_empty_groups`: a lock of revision 1 or later records empty
    # groups (`z = []`), so adding or removing one makes it stale; an older lock ignores them.
    if _revision(lock) < 1:
        have = {g: e for g, e in have.items() if e}
        want = {g: e for g, e in want.items() if e}
    if set(have) != set(want):
        return Stale(
            f"{label}: dependency groups changed (lock: {sorted(have)}; pyproject: {sorted(want)})",
            line(project, "dependency-groups"),
        )
    for group in sorted(want):
        diff = lowering.compare_entries(have[group], want[group], python)
        if diff:
            return Stale(
                f"{label}: " + difference(f"dependency group `{group}`", *diff),
                line(project, group, diff),
            )
    return None
