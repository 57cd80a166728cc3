"""The lock level: is the root's uv.lock what `uv lock` would write now; offline, no resolver.

    RF011 error    uv.lock is stale: `uv lock --check` would fail (a requirement, extra, group,
                   version, source, index, constraint, override, exclude, dependency-metadata,
                   conflict, environment, option or requires-python changed; or uv cannot read it)
    RF013 warning  rlflow cannot decide offline (dynamic dependencies need a build, a local
                   project is not checked out, settings live in uv.toml): run `uv lock --check`
    RF010 error    a submodule named in `deployed-locks` locks a package from another git commit,
                   URL or path than the root does, for a package the root installs through it

Only what affects the root's resolution is compared. uv never reads a submodule's own uv.lock
when it locks or syncs the root, so that lock is informational, unless the policy says the
submodule is also deployed from its own lock (`[tool.rlflow.pins] deployed-locks`); then that
lock must be fresh too, and agree with the root's on the packages the root gets through the
submodule, except where the root decides (its overrides, constraints with a URL and
`[tool.uv.sources]`). `lock-level = false` turns all of this off.

Staleness follows uv's own test (uv-resolver `Lock::satisfies` and `ValidatedLock::validate`):
each local project's record (version, requires-dist, provides-extras, requires-dev) and the
manifest (members, constraints, overrides, excludes, build constraints, dependency-metadata)
must equal what the pyproject files ask for, after lowering (lowering.py); markers compare by
meaning (markers.py). The checks live in settings.py (the settings in the lock's header
and manifest) and projects.py (each local project's record); the RF010 agreement of a
deployed lock with the root's in deployed.py.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from rlflow.pins import workspace
from rlflow.pins.lock import projects, settings, uvlock
from rlflow.pins.lock.words import Stale, first_stale
from rlflow.pins.model import Finding, Location
from rlflow.pins.workspace import Undecidable

LOCK = "uv.lock"
SCHEMA = 1


def lock_findings(root: Path, manifests: list, documents: list, policy) -> list[Finding]:
    if not policy.lock_level:
        return []
    parsed = {str(root / m.project): d.data for m, d in zip(manifests, documents, strict=True)}
    with workspace.reusing(parsed):
        return _lock_findings(root, manifests, documents, policy)


def _lock_findings(root: Path, manifests: list, documents: list, policy) -> list[Finding]:
    findings: list[Finding] = []
    root_lock = uvlock.read(root, LOCK, full=bool(policy.deployed_locks))
    if root_lock is not None:
        findings += freshness(root_lock, root, "", documents[0])
    by_project = {m.project: d for m, d in zip(manifests, documents, strict=True)}
    for sub, where in policy.deployed_locks.items():
        rel = f"{sub}/{LOCK}"
        lock = uvlock.read(root, rel, full=True)
        if lock is None:
            findings.append(
                _undecided(
                    where, f"`{rel}` does not exist ([tool.rlflow.pins] deployed-locks names it)"
                )
            )
            continue
        findings += freshness(lock, root, sub, by_project.get(sub))
        if root_lock is not None:
            from rlflow.pins.deployed import agreement

            findings += agreement(root_lock, lock, root, documents[0])
    return findings


def freshness(lock: uvlock.UvLock, root: Path, project: str, document) -> list[Finding]:
    try:
        stale = _stale(lock, root / project if project else root, document)
    except Undecidable as why:
        why = str(why).replace(f"{root.resolve()}{os.sep}", "")  # paths relative to the repo
        return [
            _undecided(Location(lock.file), f"cannot tell whether `{lock.file}` is fresh: {why}")
        ]
    if stale is None:
        return []
    where = stale.where or Location(lock.file, 1)
    if os.path.isabs(where.file):
        where = Location(Path(os.path.relpath(where.file, root.resolve())).as_posix(), where.line)
    return [
        Finding(
            "RF011",
            "error",
            location=where,
            detail=f"`{lock.file}` is stale: {stale.what}",
        )
    ]


def _undecided(where: Location, detail: str) -> Finding:
    return Finding("RF013", "warning", location=where, detail=detail)


# -- uv's test --------------------------------------------------------------------------------
def _stale(lock: uvlock.UvLock, directory: Path, document) -> Stale | None:
    version = lock.header.get("version")
    if version != SCHEMA:
        return Stale(
            f"it is written in lock schema version {version!r}; uv 0.13 (and rlflow) read "
            f"version {SCHEMA} only, so `uv lock --check` refuses it"
        )
    revision = lock.header.get("revision", 0)
    if not isinstance(revision, int) or isinstance(revision, bool) or revision < 0:
        return Stale(
            f"its `revision = {revision!r}` is not a lock revision (a whole number), so "
            "`uv lock --check` cannot read it"
        )
    if (directory / "uv.toml").is_file():
        raise Undecidable(
            "`uv.toml` holds uv settings that rlflow does not read; run `uv lock --check`"
        )
    data = document.data if document is not None else None
    root = (
        workspace.project_from(str(directory), data)
        if data is not None
        else workspace.load_project(str(directory))
    )
    members = workspace.workspace_members(root)
    python = lock.requires_python
    checks = (
        settings.options,
        settings.environments,
        settings.conflicts,
        settings.requires_python,
        projects.packages,
        settings.manifest,
        settings.indexes,
    )
    return first_stale(functools.partial(check, lock, root, members, python) for check in checks)
