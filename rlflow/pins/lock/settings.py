"""uv's staleness test, part one: the [tool.uv] settings a uv.lock records in its header and
manifest. Resolution options and `exclude-newer`, `environments`, `conflicts`, requires-python,
the workspace members, constraints, overrides, excludes, build constraints, dependency-metadata
and the configured indexes must be what the pyproject files ask for now (uv-resolver
`Lock::satisfies`); each check returns a `Stale` (words.py) or None, or raises `Undecidable`.
The local projects' records are projects.py's; level.py runs both.
"""

from __future__ import annotations

import re

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from rlflow.pins import markers, workspace
from rlflow.pins.lock import lowering, projects, uvlock
from rlflow.pins.lock.words import Stale, difference, line, shown, texts
from rlflow.pins.pep508 import canonicalize_name
from rlflow.pins.workspace import Undecidable

_OPTIONS = {
    "resolution-mode": ("resolution", "highest"),
    "prerelease-mode": ("prerelease", "if-necessary-or-explicit"),
    "fork-strategy": ("fork-strategy", "requires-python"),
}


def options(lock, root, members, python) -> Stale | None:
    options = lock.header.get("options", {}) if isinstance(lock.header.get("options"), dict) else {}
    for key, (setting, default) in _OPTIONS.items():
        have = options.get(key, default)
        want = root.uv.get(setting, default)
        if str(have) != str(want):
            return Stale(
                f"[tool.uv] {setting} is `{want}` but the lock was resolved with `{have}`",
                line(root, setting) if setting in root.uv else None,
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
                f"[tool.uv] exclude-newer is {shown(want)}, the lock was resolved with "
                f"{f'the span `{span}`' if span else shown(options.get('exclude-newer'))} "
                "(uv compares a span as written: `7 days` is not `1 week`)",
                line(root, "exclude-newer"),
            )
        pairs = pairs[1:]  # the lock's timestamp is a placeholder then
    for setting, have, want in pairs:
        if have is None and want is None:
            continue
        where = line(root, "exclude-newer")
        if have is None or want is None:
            return Stale(
                f"[tool.uv] {setting} is {shown(want)}, the lock was resolved with {shown(have)}",
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


def environments(lock, root, members, python) -> Stale | None:
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
                line(root, setting) if setting in root.uv else None,
            )
    return None


def _same_markers(have: list[str], want: list[str], python) -> bool:
    try:
        parsed = [markers.parse(m) for m in have], [markers.parse(m) for m in want]
    except ValueError:
        return sorted(have) == sorted(want)
    return markers.equivalent_sets(*parsed, python) is not False


def conflicts(lock, root, members, python) -> Stale | None:
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
            "[tool.uv] conflicts changed since the lock was written", line(root, "conflicts")
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


def requires_python(lock, root, members, python) -> Stale | None:
    wanted = [m.table.get("requires-python") for m in members.values()]
    wanted = [w for w in wanted if isinstance(w, str)]
    if not wanted or python is None:
        return None
    want = ",".join(wanted)
    if not _same_range(python, want):
        return Stale(
            f"requires-python is `{want}` but the lock has `{python}`",
            line(root, "requires-python"),
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


def manifest(lock, root, members, python) -> Stale | None:
    manifest = lock.manifest
    have_members = {canonicalize_name(str(m)) for m in manifest.get("members", [])}
    if (len(members) > 1 or have_members) and have_members != set(members):
        return Stale(
            f"the workspace members are {sorted(members)} but the lock has {sorted(have_members)}",
            line(root, "members"),
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
        want = [e for t in texts(root.uv.get(setting)) for e in lowering.lower(t, root)]
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
            return Stale(difference(f"[tool.uv] {setting}", *diff), line(root, setting, diff))
    have_ex = {canonicalize_name(str(n)) for n in manifest.get("excludes", []) or []}
    want_ex = {canonicalize_name(n) for n in texts(root.uv.get("exclude-dependencies"))}
    want_ex = {n for n in want_ex if n in locked | have_ex}
    if want_ex != have_ex:
        return Stale(
            "[tool.uv] exclude-dependencies changed since the lock was written",
            line(root, "exclude-dependencies"),
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
            line(root, "dependency-metadata"),
        )
    if not root.name:
        # A virtual root's groups live in the manifest, where uv 0.13 skips empty ones (measured).
        want_groups = {g: e for g, e in lowering.groups(root).items() if e}
        have_groups = {g: e for g, e in (manifest.get("dependency-groups", {}) or {}).items() if e}
        return projects.groups(
            "the root's dependency-groups", have_groups, want_groups, lock, python, root
        )
    return None


def indexes(lock, root, members, python) -> Stale | None:
    """uv re-resolves when a locked registry is no longer configured (only when some index is)."""
    package = uvlock.unconfigured_registry(lock, list(members.values()) or [root])
    if package is None:
        return None
    return Stale(
        f"`{package.name}` {package.version} is locked from `{package.source['registry']}`, "
        "which no [[tool.uv.index]], index-url or find-links names any more",
        line(root, "index"),
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
        for t in texts(entry.get("requires-dist"))
        for e in lowering.lower(t, workspace.Project("/", {}, {}, {}))
    ]
    extras = tuple(
        sorted(canonicalize_name(str(x)) for x in entry.get("provides-extras", []) or [])
    )
    scalars = (version, str(entry.get("requires-python") or ""), extras)
    return canonicalize_name(str(entry.get("name", ""))), (scalars, requires)
