"""Pins + submodule state + policy -> findings with stable codes; pure (no I/O).

    RF001 error    one package, two git/URL/path sources (uv: "conflicting URLs")
    RF002 warning  a submodule that uv does not reach through path dependencies pins a
                   package by git/URL, and the root does not
    RF003 error    one index name, two URLs (uv: "conflicting indexes"; a trailing slash counts)
    RF004 error    version specifiers no version satisfies (e.g. ==0.6.8.post1 vs ==0.6.18.post1)
    RF005 error    a `lockstep` package is not pinned identically at the root
    RF006 error    submodule checked out at another commit than its parent's gitlink
    RF007 warning  submodule not initialized (its pins cannot be checked)
    RF008 error    submodule pyproject.toml has uncommitted changes
    RF009 warning  a [tool.rlflow.pins] entry matches nothing
    RF014 error    a nested gitlink is staged in its parent submodule but not committed there:
                   the parent's commit, which the root records, still has the old one

(`--strict` turns every warning into an error.) A root `override-dependencies` entry wins:
its package is never a conflict.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from rlflow.pins.model import Finding, IndexDef, Manifest, Pin, Submodule
from rlflow.pins.policy import Policy
from rlflow.pins.reach import effective_pins, meet
from rlflow.pins.versions import disjoint

URL_KINDS = ("git", "url", "path")


def compare(
    manifests: list[Manifest], submodules: tuple[Submodule, ...], policy: Policy
) -> list[Finding]:
    """All findings for one checkout; `manifests[0]` is the root."""
    root = manifests[0]
    overridden = {r.package for r in root.requirements if r.scope == "override"}
    by_package: dict[str, list[Pin]] = defaultdict(list)
    for pin in effective_pins(manifests):
        by_package[pin.package].append(pin)
    findings: list[Finding] = []
    by_path = path_reached(manifests)
    for package in sorted(by_package):
        if package not in overridden:
            findings += package_findings(
                package, by_package[package], root.conflicts, policy, by_path
            )
    findings += index_findings(manifests)
    findings += state_findings(submodules)
    findings += [
        Finding("RF009", "warning", package=name, location=where, detail=f"lockstep entry `{name}`")
        for name, where in policy.lockstep.items()
        if name not in by_package
    ]
    return findings


def path_reached(manifests: list[Manifest]) -> set[str]:
    """Projects uv reaches from the root through local path dependencies only. uv honours
    their `[tool.uv.sources]` and accepts their URL pins, root declaration or not."""
    by_directory = {m.directory: m for m in manifests}
    reached, queue = {manifests[0].project}, [manifests[0]]
    while queue:
        manifest = queue.pop()
        pins = [p for p, _ in manifest.sources] + [r.pin for r in manifest.requirements if r.pin]
        for pin in pins:
            target = by_directory.get(pin.key.removeprefix("path:")) if pin.kind == "path" else None
            if target is not None and target.project not in reached:
                reached.add(target.project)
                queue.append(target)
    return reached


def package_findings(
    package: str,
    pins: list[Pin],
    conflicts: tuple[frozenset[str], ...],
    policy: Policy,
    by_path: set[str] = frozenset(),
) -> list[Finding]:
    if len(pins) == 1 and pins[0].kind not in URL_KINDS and package not in policy.lockstep:
        return []  # one version or index pin, not in lockstep: nothing to compare it with
    url_pins = [p for p in pins if p.kind in URL_KINDS]
    version_pins = [p for p in pins if p.kind == "version"]
    index_pins = [p for p in pins if p.kind == "index"]
    pairs = _pairs(url_pins, lambda a, b: a.key != b.key, conflicts)
    findings = _grouped("RF001", package, pairs)
    # path deps between checkouts are fine; so are URL pins of path-reached projects (uv too)
    remote = [p for p in url_pins if p.kind != "path" and p.project not in by_path]
    if remote and not any(p.is_root for p in url_pins):
        findings.append(Finding("RF002", "warning", package=package, theirs=tuple(remote)))
    version_pairs = _pairs(version_pins, lambda a, b: disjoint(a.key, b.key), conflicts)
    findings += _grouped("RF004", package, version_pairs)
    index_pairs = _pairs(
        index_pins, lambda a, b: a.key != b.key and a.display != b.display, conflicts
    )
    findings += _grouped("RF003", package, index_pairs)
    if package in policy.lockstep:
        reported = {(id(a), id(b)) for a, b in pairs + version_pairs}
        findings += _lockstep(package, pins, conflicts, reported)
    return findings


def index_findings(manifests: list[Manifest]) -> list[Finding]:
    by_name: dict[str, list[IndexDef]] = defaultdict(list)
    for manifest in manifests:
        for index in manifest.indexes:
            by_name[index.name].append(index)
    findings = []
    for name in sorted(by_name):
        pairs = _pairs(by_name[name], lambda a, b: a.url != b.url, ())
        findings += _grouped("RF003", None, pairs)
    return findings


def state_findings(submodules: tuple[Submodule, ...]) -> list[Finding]:
    findings = []
    declared_in = {s.path: s.declared_at.file for s in submodules}
    for sub in submodules:
        if not sub.initialized:
            findings.append(Finding("RF007", "warning", submodule=sub, location=sub.declared_at))
            continue
        if sub.gitlink and sub.head != sub.gitlink:
            findings.append(Finding("RF006", "error", submodule=sub, location=sub.declared_at))
        if sub.pyproject_dirty:
            findings.append(Finding("RF008", "error", submodule=sub, location=sub.declared_at))
        if sub.committed is not None and sub.gitlink != sub.committed:
            parent = sub.declared_at.file.rsplit("/", 1)[0]
            findings.append(
                Finding(
                    "RF014",
                    "error",
                    submodule=sub,
                    location=sub.declared_at,
                    detail=declared_in.get(parent, ".gitmodules"),  # where the parent is declared
                )
            )
    return findings


def _lockstep(package: str, pins: list[Pin], conflicts, reported: set) -> list[Finding]:
    """Lockstep packages must be pinned identically (same URL, same specifiers) at the root."""
    root_pins = [p for p in pins if p.is_root]
    sub_pins = [p for p in pins if not p.is_root]
    if sub_pins and not root_pins:
        return [Finding("RF005", "error", package=package, theirs=tuple(sub_pins))]

    def differs(a: Pin, b: Pin) -> bool:
        same_family = (a.kind in URL_KINDS) == (b.kind in URL_KINDS)
        return same_family and a.key != b.key and (id(a), id(b)) not in reported

    pairs = [(r, s) for r in root_pins for s in sub_pins if differs(r, s) and meet(r, s, conflicts)]
    return _grouped("RF005", package, pairs)


def _pairs(sites: list, differs: Callable, conflicts) -> list[tuple]:
    """(ours, theirs) for every pair that disagrees and can meet; the root side is `ours`.

    In the order of a loop over all pairs, but each answer is computed once per pair of
    distinct sites (same values, markers, reach and side): 20,000 copies of one requirement
    are one site, not 200 million pairs."""
    if len(sites) < 2:
        return []
    groups: dict[tuple, list[int]] = {}  # signature -> indices of its sites, ascending
    for i, site in enumerate(sites):
        groups.setdefault(_signature(site), []).append(i)
    members = list(groups.values())
    partners: dict[int, list[list[int]]] = {}  # group -> the groups it disagrees with
    for g, first in enumerate(members):
        for h in range(g if len(first) > 1 else g + 1, len(members)):
            a, b = sites[first[0]], sites[members[h][0]]
            if isinstance(a, Pin) and not meet(a, b, conflicts):
                continue
            if differs(a, b):  # both questions are symmetric
                partners.setdefault(g, []).append(members[h])
                if h != g:
                    partners.setdefault(h, []).append(first)
    out = []
    group_of = {i: g for g, indices in enumerate(members) for i in indices}
    for i, a in enumerate(sites):
        later = sorted(j for other in partners.get(group_of[i], ()) for j in other if j > i)
        for j in later:
            b = sites[j]
            out.append((b, a) if b.is_root and not a.is_root else (a, b))
    return out


def _signature(site) -> tuple:
    """Everything `_pairs`' callers compare (and which side is the root's)."""
    if isinstance(site, Pin):
        return (site.kind, site.key, site.display, site.marker, site.reach, site.is_root)
    return (site.name, site.url, site.is_root)


def _grouped(code: str, package: str | None, pairs: list[tuple]) -> list[Finding]:
    """One finding per `ours` site, listing everything it disagrees with."""
    theirs_of: dict[int, list] = defaultdict(list)
    ours_of: dict[int, object] = {}
    for ours, theirs in pairs:
        ours_of[id(ours)] = ours
        theirs_of[id(ours)].append(theirs)
    return [
        Finding(
            code,
            "error",
            package=package or _index_name(ours),
            ours=ours,
            theirs=tuple(theirs_of[key]),
        )
        for key, ours in ours_of.items()
    ]


def _index_name(site) -> str | None:
    return site.name if isinstance(site, IndexDef) else None
