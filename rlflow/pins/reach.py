"""Which pins uv will combine: the root's, plus each submodule's installed scopes; pure.

uv resolves the root's dependencies, all its extras and groups (each under its own scope),
and, for a local project the root requires by name (`megatron-bridge[te]`), that project's
dependencies plus the extras asked for, recursively. A submodule's dependency groups and
unrequested extras are never installed, so their pins cannot conflict. A submodule that
nothing requires by name is a pinned checkout used some other way: all its dependencies and
extras count (conservative).

Every pin gets `reach`: the root scopes under which it is installed ("" = always). Two pins
can only conflict if they meet: some pair of their scopes is not declared mutually exclusive
in the root's `[tool.uv] conflicts` (uv resolves those in separate forks).
"""

from __future__ import annotations

from collections import defaultdict

from rlflow.pins.model import ALWAYS, Manifest, Pin
from rlflow.pins.records import replace

_INSTALLS = "dependencies"


def effective_pins(manifests: list[Manifest]) -> list[Pin]:
    """Every pin uv would see, with its reach; the root manifest comes first."""
    root, subs = manifests[0], manifests[1:]
    scopes = _activated_scopes(root, subs)
    pins = _project_pins(root, {s: {_root_scope(s)} for s in _all_scopes(root)})
    for sub in subs:
        active = scopes.get(sub.project)
        if active is None:  # required by nobody: count everything it installs
            active = {s: {ALWAYS} for s in _all_scopes(sub) if not s.startswith("group:")}
        pins += _project_pins(sub, active)
    return pins


def meet(a: Pin, b: Pin, conflicts: tuple[frozenset[str], ...]) -> bool:
    """Can uv see both pins in one resolution (one fork, compatible markers)?"""
    if a.marker and b.marker and a.marker != b.marker:
        return False  # different markers may never hold together: no claim either way
    return any(_compatible(x, y, conflicts) for x in a.reach for y in b.reach)


def _compatible(x: str, y: str, conflicts: tuple[frozenset[str], ...]) -> bool:
    if ALWAYS in (x, y) or x == y:
        return True
    return not any(x in group and y in group for group in conflicts)


def _root_scope(scope: str) -> str:
    return scope if scope.startswith(("extra:", "group:")) else ALWAYS


def _all_scopes(manifest: Manifest) -> set[str]:
    return {_INSTALLS} | {r.scope for r in manifest.requirements}


def _activated_scopes(root: Manifest, subs: list[Manifest]) -> dict[str, dict[str, set[str]]]:
    """project -> {scope of that project: root scopes that install it}, by walking names."""
    by_name: dict[str, list[Manifest]] = defaultdict(list)
    for sub in subs:
        if sub.name:
            by_name[sub.name].append(sub)
    active: dict[str, dict[str, set[str]]] = {}
    queue = [
        (req, _root_scope(req.scope))
        for req in root.requirements
        if req.scope not in ("constraint", "override")
    ]
    while queue:
        req, root_scope = queue.pop()
        for sub in by_name.get(req.package, []):
            for scope in [_INSTALLS] + [f"extra:{e}" for e in sorted(req.extras)]:
                seen = active.setdefault(sub.project, {}).setdefault(scope, set())
                if root_scope in seen:
                    continue
                seen.add(root_scope)
                queue += [(r, root_scope) for r in sub.requirements if r.scope == scope]
    return active


def _project_pins(manifest: Manifest, active: dict[str, set[str]]) -> list[Pin]:
    """The project's pins in its active scopes, each with the union of root scopes reaching it."""
    pins = []
    scopes_of: dict[str, list[str]] = defaultdict(list)  # package -> its requirements' scopes
    sourced: dict[str, set[str | None]] = defaultdict(set)  # package -> its sources' scopes
    for pin, scope in manifest.sources:
        sourced[pin.package].add(scope)
    for req in manifest.requirements:
        scopes_of[req.package].append(req.scope)
        if req.scope in active:
            if req.pin is not None and not _replaced_by_source(req, sourced):
                pins.append(_reaching(req.pin, active[req.scope]))
    for pin, scope in manifest.sources:
        reach = _source_reach(scopes_of[pin.package], scope, active)
        if reach:  # a source applies only to the project's own requirements of that package
            pins.append(_reaching(pin, reach))
    for pin in manifest.metadata_pins:
        pins.append(_reaching(pin, {ALWAYS}))
    if manifest.version_pin is not None:
        pins.append(_reaching(manifest.version_pin, {ALWAYS}))
    return pins


def _reaching(pin: Pin, reach: set[str]) -> Pin:
    """`pin` with `reach`; the pin itself when it has it already (most do: `{ALWAYS}`)."""
    return pin if pin.reach == reach else replace(pin, reach=frozenset(reach))


def _replaced_by_source(req, sourced: dict[str, set[str | None]]) -> bool:
    """uv gives a requirement the URL of the project's source for that package, even when the
    requirement names its own URL (`x @ git+...@v1` with a source at v2 resolves to v2)."""
    if req.pin.kind not in ("git", "url", "path"):
        return False
    scopes = sourced.get(req.package, ())
    return None in scopes or req.scope in scopes


def _source_reach(
    scopes: list[str], limited_to: str | None, active: dict[str, set[str]]
) -> set[str]:
    """The root scopes reaching a source: those of the project's requirements of its package
    (in the scope it is limited to, if any)."""
    reach: set[str] = set()
    for scope in scopes:
        if scope in active and (limited_to is None or scope == limited_to):
            reach |= active[scope]
    return reach
