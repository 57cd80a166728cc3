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
meaning (markers.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from rlflow.pins import lowering, markers, uvlock
from rlflow.pins.lowering import Undecidable
from rlflow.pins.model import Finding, Location
from rlflow.pins.pep508 import canonicalize_name
from rlflow.pins.records import record

LOCK = "uv.lock"
SCHEMA = 1
_OPTIONS = {
    "resolution-mode": ("resolution", "highest"),
    "prerelease-mode": ("prerelease", "if-necessary-or-explicit"),
    "fork-strategy": ("fork-strategy", "requires-python"),
}


@record
class Stale:
    what: str
    where: Location | None = None


def lock_findings(root: Path, manifests: list, documents: list, policy) -> list[Finding]:
    if not policy.lock_level:
        return []
    parsed = {str(root / m.project): d.data for m, d in zip(manifests, documents, strict=True)}
    with lowering.reusing(parsed):
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
        lowering.project_from(str(directory), data)
        if data is not None
        else lowering.load_project(str(directory))
    )
    members = lowering.workspace_members(root)
    python = lock.requires_python
    undecided = None
    for check in (
        _options,
        _environments,
        _conflicts,
        _requires_python,
        _packages,
        _manifest,
        _indexes,
    ):
        try:
            found = check(lock, root, members, python)
        except Undecidable as why:  # a later check may still find the lock stale for certain
            undecided = undecided or why
            continue
        if found:
            return found
    if undecided:
        raise undecided
    return None


def _options(lock, root, members, python) -> Stale | None:
    options = lock.header.get("options", {}) if isinstance(lock.header.get("options"), dict) else {}
    for key, (setting, default) in _OPTIONS.items():
        have = options.get(key, default)
        want = root.uv.get(setting, default)
        if str(have) != str(want):
            return Stale(
                f"[tool.uv] {setting} is `{want}` but the lock was resolved with `{have}`",
                _line(root, setting) if setting in root.uv else None,
            )
    return _exclude_newer(lock, root, options)


def _exclude_newer(lock, root, options: dict) -> Stale | None:
    """uv 0.13 (measured): `exclude-newer` added, removed or moved earlier makes the lock stale;
    moved later (or respelled: a date means the end of that day, UTC) it does not. The same per
    package in `exclude-newer-package`, for packages in the lock."""
    locked = {p.name for p in lock.packages}
    have_pkg = options.get("exclude-newer-package")
    want_pkg = root.uv.get("exclude-newer-package")
    have_pkg = have_pkg if isinstance(have_pkg, dict) else {}
    want_pkg = want_pkg if isinstance(want_pkg, dict) else {}
    pairs = [("exclude-newer", options.get("exclude-newer"), root.uv.get("exclude-newer"))]
    for name in sorted({canonicalize_name(str(n)) for n in [*have_pkg, *want_pkg]} & locked):
        have = next((v for k, v in have_pkg.items() if canonicalize_name(str(k)) == name), None)
        want = next((v for k, v in want_pkg.items() if canonicalize_name(str(k)) == name), None)
        pairs.append((f"exclude-newer-package `{name}`", have, want))
    span = options.get("exclude-newer-span")  # a relative `exclude-newer`: "1 week" is P1W
    if span is not None or _span(root.uv.get("exclude-newer")) is not None:
        want = root.uv.get("exclude-newer")
        if span is None or _span(want) != _span(span) or _span(span) is None:
            if span is not None and _span(want) is None and _instant(want) is None:
                raise Undecidable(
                    f"[tool.uv] exclude-newer is `{want}` and the lock has the span `{span}`; "
                    "rlflow reads RFC 3339 timestamps, dates and simple spans (`1 week`) only"
                )
            return Stale(
                f"[tool.uv] exclude-newer is {_shown(want)}, the lock was resolved with "
                f"{f'the span `{span}`' if span else _shown(options.get('exclude-newer'))} "
                "(uv compares a span as written: `7 days` is not `1 week`)",
                _line(root, "exclude-newer"),
            )
        pairs = pairs[1:]  # the lock's timestamp is a placeholder then
    for setting, have, want in pairs:
        if have is None and want is None:
            continue
        where = _line(root, "exclude-newer")
        if have is None or want is None:
            return Stale(
                f"[tool.uv] {setting} is {_shown(want)}, the lock was resolved with {_shown(have)}",
                where,
            )
        old, new = _instant(have), _instant(want)
        if old is None or new is None:
            raise Undecidable(
                f"[tool.uv] {setting} is `{want}` and the lock has `{have}`; rlflow reads only "
                "RFC 3339 timestamps and dates there"
            )
        if new < old:
            return Stale(
                f"[tool.uv] {setting} moved earlier, to `{want}`, than the `{have}` the lock was "
                "resolved with",
                where,
            )
    return None


_UNITS = {
    "Y": ("y", "year", "years"),
    "M": ("month", "months", "mo"),
    "W": ("w", "week", "weeks"),
    "D": ("d", "day", "days"),
    "TH": ("h", "hour", "hours"),
    "TM": ("min", "mins", "minute", "minutes"),
    "TS": ("s", "sec", "secs", "second", "seconds"),
}


def _span(value) -> tuple | None:
    """`1 week`, `1w`, `P1W` -> (("W", 1),): a relative exclude-newer in the unit it is written
    in (uv records `exclude-newer-span = "P1W"` and, measured, `7 days` is another span)."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    iso = re.fullmatch(
        r"P(?:(\d+)Y)?(?:(\d+)M)?(?:(\d+)W)?(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?",
        text,
    )
    if iso and any(iso.groups()):
        return tuple((u, int(n)) for u, n in zip(_UNITS, iso.groups(), strict=True) if n)
    friendly = re.fullmatch(r"(\d+)\s*([A-Za-z]+)", text)
    if friendly:
        word = friendly.group(2).lower()
        unit = next((u for u, words in _UNITS.items() if word in words), None)
        if unit:
            return ((unit, int(friendly.group(1))),)
    return None


def _instant(value):
    from datetime import UTC, datetime, timedelta

    if not isinstance(value, str):
        return None
    text = value.strip()
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            return datetime.fromisoformat(text).replace(tzinfo=UTC) + timedelta(days=1)
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else None


def _environments(lock, root, members, python) -> Stale | None:
    for setting, key in (
        ("environments", "supported-markers"),
        ("required-environments", "required-markers"),
    ):
        want = root.uv.get(setting, [])
        want = [want] if isinstance(want, str) else [w for w in want if isinstance(w, str)]
        have = [h for h in lock.header.get(key, []) if isinstance(h, str)]
        if bool(want) != bool(have) or not _same_markers(have, want, python):
            return Stale(
                f"[tool.uv] {setting} is {', '.join(f'`{m}`' for m in want) or 'unset'} but "
                f"the lock was resolved for {', '.join(f'`{m}`' for m in have) or 'any environment'}",
                _line(root, setting) if setting in root.uv else None,
            )
    return None


def _same_markers(have: list[str], want: list[str], python) -> bool:
    try:
        parsed = [markers.parse(m) for m in have], [markers.parse(m) for m in want]
    except ValueError:
        return sorted(have) == sorted(want)
    return markers.equivalent_sets(*parsed, python) is not False


def _conflicts(lock, root, members, python) -> Stale | None:
    want = set()
    for name, member in members.items():
        for group in (
            member.uv.get("conflicts", []) if isinstance(member.uv.get("conflicts"), list) else []
        ):
            want.add(frozenset(_conflict_item(i, name) for i in group if isinstance(i, dict)))
    have = set()
    for group in (
        lock.header.get("conflicts", []) if isinstance(lock.header.get("conflicts"), list) else []
    ):
        have.add(frozenset(_conflict_item(i, None) for i in group if isinstance(i, dict)))
    if want != have:
        return Stale(
            "[tool.uv] conflicts changed since the lock was written", _line(root, "conflicts")
        )
    return None


def _conflict_item(item: dict, project: str | None) -> tuple:
    kind = "extra" if "extra" in item else "group" if "group" in item else "package"
    package = item.get("package", project)
    return (
        canonicalize_name(str(package)) if package else None,
        kind,
        canonicalize_name(str(item.get(kind, ""))),
    )


def _requires_python(lock, root, members, python) -> Stale | None:
    wanted = [m.table.get("requires-python") for m in members.values()]
    wanted = [w for w in wanted if isinstance(w, str)]
    if not wanted or python is None:
        return None
    want = ",".join(wanted)
    if not _same_range(python, want):
        return Stale(
            f"requires-python is `{want}` but the lock has `{python}`",
            _line(root, "requires-python"),
        )
    return None


def _same_range(a: str, b: str) -> bool:
    """uv keeps only the bounds of requires-python (uv-resolver RequiresPython): `!=` holes do
    not change the lock (`>=3.12,!=3.13.*` is `>=3.12`, measured)."""
    try:
        left, right = (
            SpecifierSet(",".join(str(p) for p in SpecifierSet(x) if p.operator != "!="))
            for x in (a, b)
        )
    except InvalidSpecifier:
        return a == b
    points = markers._python_points({s.version for s in list(left) + list(right)}, None)
    return all(
        left.contains(p, prereleases=True) == right.contains(p, prereleases=True) for p in points
    )


def _manifest(lock, root, members, python) -> Stale | None:
    manifest = lock.manifest
    have_members = {canonicalize_name(str(m)) for m in manifest.get("members", [])}
    if (len(members) > 1 or have_members) and have_members != set(members):
        return Stale(
            f"the workspace members are {sorted(members)} but the lock has {sorted(have_members)}",
            _line(root, "members"),
        )
    directory = lock.directory
    locked = {p.name for p in lock.packages}
    # uv 0.13 (measured): a new constraint, override, exclude or dependency-metadata entry for a
    # package the lock has never seen does not make it stale; build constraints always count.
    for key, setting, filtered in (
        ("constraints", "constraint-dependencies", True),
        ("overrides", "override-dependencies", True),
        ("build-constraints", "build-constraint-dependencies", False),
    ):
        have = [uvlock.entry(i, directory) for i in manifest.get(key, []) or []]
        known = locked | {e[0] for e in have}
        want = [e for t in _texts(root.uv.get(setting)) for e in lowering.lower(t, root)]
        want = [e for e in want if not filtered or e[0] in known]
        if key == "constraints":  # uv-configuration NormalizedConstraints: extras ignored, and
            have, want = _constraints(have), _constraints(want)  # bare names restrict nothing
        diff = lowering.compare_entries(have, want, python)
        if diff:
            if root.uv.get("preview") is True or root.uv.get("preview-features"):
                raise Undecidable(
                    f"[tool.uv] {setting} changed, and with uv's preview features on, uv may "
                    "accept the lock anyway (it does for NeMo-RL's)"
                )
            return Stale(_difference(f"[tool.uv] {setting}", *diff), _line(root, setting, diff))
    have_ex = {canonicalize_name(str(n)) for n in manifest.get("excludes", []) or []}
    want_ex = {canonicalize_name(n) for n in _texts(root.uv.get("exclude-dependencies"))}
    want_ex = {n for n in want_ex if n in locked | have_ex}
    if want_ex != have_ex:
        return Stale(
            "[tool.uv] exclude-dependencies changed since the lock was written",
            _line(root, "exclude-dependencies"),
        )
    have_meta = dict(
        _metadata(m) for m in manifest.get("dependency-metadata", []) or [] if isinstance(m, dict)
    )
    known = locked | set(have_meta)
    want_meta = dict(
        _metadata(m) for m in root.uv.get("dependency-metadata", []) or [] if isinstance(m, dict)
    )
    want_meta = {n: m for n, m in want_meta.items() if n in known}
    changed = sorted(
        n
        for n in set(have_meta) | set(want_meta)
        if n not in have_meta
        or n not in want_meta
        or have_meta[n][0] != want_meta[n][0]
        or lowering.compare_entries(have_meta[n][1], want_meta[n][1], python) is not None
    )
    if changed:
        return Stale(
            f"[[tool.uv.dependency-metadata]] changed since the lock was written (`{'`, `'.join(changed)}`)",
            _line(root, "dependency-metadata"),
        )
    if not root.name:
        # A virtual root's groups live in the manifest, where uv 0.13 skips empty ones (measured).
        want_groups = {g: e for g, e in lowering.groups(root).items() if e}
        have_groups = {g: e for g, e in (manifest.get("dependency-groups", {}) or {}).items() if e}
        return _groups("the root's dependency-groups", have_groups, want_groups, lock, python, root)
    return None


def _indexes(lock, root, members, python) -> Stale | None:
    """uv re-resolves when a locked registry is no longer configured (only when some index is)."""
    package = uvlock.unconfigured_registry(lock, list(members.values()) or [root])
    if package is None:
        return None
    return Stale(
        f"`{package.name}` {package.version} is locked from `{package.source['registry']}`, "
        "which no [[tool.uv.index]], index-url or find-links names any more",
        _line(root, "index"),
    )


def _constraints(entries: list) -> list:
    return [
        (name, (), source, marker)
        for name, _, source, marker in entries
        if not (source[0] == "registry" and not source[1])
    ]


def _metadata(entry: dict) -> tuple:
    """A dependency-metadata entry -> (name, (version, requires-python, extras), requires-dist
    entries); versions compare as versions (0.3 == 0.3.0), requires-dist as uv merges it."""
    from packaging.version import InvalidVersion, Version

    version = entry.get("version")
    try:
        version = Version(version) if isinstance(version, str) else None
    except InvalidVersion:
        pass
    requires = [
        e
        for t in _texts(entry.get("requires-dist"))
        for e in lowering.lower(t, lowering.Project("/", {}, {}, {}))
    ]
    extras = tuple(
        sorted(canonicalize_name(str(x)) for x in entry.get("provides-extras", []) or [])
    )
    scalars = (version, str(entry.get("requires-python") or ""), extras)
    return canonicalize_name(str(entry.get("name", ""))), (scalars, requires)


def _packages(lock, root, members, python) -> Stale | None:
    """Every local project in the lock: workspace members and the path dependencies uv reads."""
    by_dir = {m.directory: m for m in members.values()}
    local = lock.local()
    for name, member in members.items():
        package = next((p for p in local if p.name == name), None)
        if package is None:
            return Stale(f"the lock has no entry for project `{name}`", _line(root, "name"))
        virtual = _virtual(member)
        if virtual is not None and virtual != (package.local_kind == "virtual"):
            now = "virtual (not built)" if virtual else "a package"
            return Stale(f"`{name}` is now {now}; the lock has it {package.local_kind}")
    undecided = None
    for package in local:
        try:
            found = _local(lock, package, by_dir, members, python, root)
        except Undecidable as why:  # another project may still be stale for certain
            undecided = undecided or why
            continue
        if found:
            return found
    if undecided:
        raise undecided
    return None


def _local(lock, package, by_dir, members, python, root) -> Stale | None:
    directory = lock.path_of(package)
    project = by_dir.get(directory)
    if project is None:
        if not os.path.isdir(directory):
            raise Undecidable(
                f"local project `{package.name}` at `{directory}` is not there (a submodule not checked out?)"
            )
        project = lowering.load_project(directory)
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
            f"`{package.name}`: [tool.uv] default-groups is {_shown(want)}, the lock has "
            f"{_shown(have)}",
            _line(project, "default-groups"),
        )
    return None


def _shown(value) -> str:
    return "unset" if value is None else f"`{value}`"


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
        " (the root project)" if project is root else f" (`{_rel(lock, project.directory)}`)"
    )
    if package.local_kind != "virtual":
        if wanted.version is None and package.version is not None:
            return Stale(f"{label} now has a dynamic version; the lock records {package.version}")
        if wanted.version is not None and not lowering.same_version(
            package.version, wanted.version
        ):
            return Stale(
                f"{label} is version {wanted.version}, the lock has {package.version}",
                _line(project, "version"),
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
                _line(project, "optional-dependencies"),
            )
    have = [uvlock.entry(i, lock.directory) for i in metadata.get("requires-dist", []) or []]
    diff = lowering.compare_entries(have, wanted.requires_dist, python)
    if diff:
        return Stale(
            f"{label}: " + _difference("requires-dist", *diff), _line(project, "dependencies", diff)
        )
    dev = metadata.get("requires-dev", {}) if isinstance(metadata.get("requires-dev"), dict) else {}
    return _groups(label, dev, wanted.requires_dev, lock, python, project)


def _groups(label, have_raw: dict, want: dict, lock, python, project) -> Stale | None:
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
            _line(project, "dependency-groups"),
        )
    for group in sorted(want):
        diff = lowering.compare_entries(have[group], want[group], python)
        if diff:
            return Stale(
                f"{label}: " + _difference(f"dependency group `{group}`", *diff),
                _line(project, group, diff),
            )
    return None


# -- words ------------------------------------------------------------------------------------
def _difference(what: str, added: list, removed: list) -> str:
    def show(key) -> str:
        name, extras, source = key
        extra = f"[{','.join(extras)}]" if extras else ""
        return f"`{name}{extra}{_source_text(source)}`"

    parts = []
    if added:
        parts.append("not locked as written: " + ", ".join(show(k) for k in added[:3]))
    if removed:
        parts.append("locked but no longer asked for: " + ", ".join(show(k) for k in removed[:3]))
    return f"{what} changed since the lock was written ({'; '.join(parts)})"


def _source_text(source: tuple) -> str:
    kind = source[0]
    if kind == "registry":
        spec = (
            ",".join(op + v for op, v in source[1]) if source[1] and len(source[1][0]) == 2 else ""
        )
        return spec + (f" from index {source[2]}" if source[2] else "")
    if kind == "git":
        return f" @ git {source[1]}" + (f"@{source[3]}" if source[3] else "")
    if kind == "url":
        return f" @ {source[1]}"
    return f" from {source[1]} path {source[2]}"


def _rel(lock, directory: str) -> str:
    return os.path.relpath(directory, lock.directory)


def _line(project, key: str, diff=None) -> Location | None:
    """The pyproject line that sets `key` (or names the first changed package)."""
    path = Path(project.directory) / "pyproject.toml"
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError:
        return None
    names = [k[0] for k in (diff[0] or diff[1])] if diff else []
    patterns = [
        re.compile(r"[\"']\s*" + "[-_.]?".join(re.escape(p) for p in re.split(r"[-_.]", n)), re.I)
        for n in names[:1]
    ]
    setting = re.compile(rf"^\s*\[?\[?[\w.\"-]*{re.escape(key)}\b")
    rel = str(path)
    at = next((n for n, line in enumerate(lines, start=1) if setting.search(line)), None)
    for pattern in patterns:  # the changed package: under its setting first, then anywhere
        for start in (at, 1) if at else (1,):
            for number, line in enumerate(lines[start - 1 :], start=start):
                if pattern.search(line):
                    return Location(rel, number)
    return Location(rel, at)


def _texts(value) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []
