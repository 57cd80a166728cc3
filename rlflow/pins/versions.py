"""Do two version specifier sets leave any version that satisfies both?; pure.

Each set becomes an interval on the PEP 440 version line (`==1.2.*` and `~=` as ranges); `!=`
then empties it when the interval is one version or lies inside an excluded `!=1.2.*`. That interval is a superset of what the set really allows, so an empty intersection
is a sure conflict. Local versions (`==1.0` also allows `1.0+cu130`) and `===` are settled by
testing the literal versions of both sets. Result: `disjoint` never reports a pair that some
version satisfies (no false alarms); a few exotic empty pairs are left to uv.
"""

from __future__ import annotations

from packaging.specifiers import Specifier, SpecifierSet
from packaging.version import InvalidVersion, Version

Bound = tuple[Version, bool] | None  # (version, inclusive); None = unbounded


def disjoint(a: str, b: str) -> bool:
    """True when no version satisfies both `a` and `b` (comma-separated specifiers)."""
    set_a, set_b = SpecifierSet(a), SpecifierSet(b)
    specs = list(set_a) + list(set_b)
    low, high = _interval(specs)
    if _nonempty(low, high) and not _excluded(low, high, specs, set_a, set_b):
        return False
    for version in _literals(set_a, set_b):
        if set_a.contains(version, prereleases=True) and set_b.contains(version, prereleases=True):
            return False
    return True


def _excluded(low: Bound, high: Bound, specs: list[Specifier], *sets: SpecifierSet) -> bool:
    """`!=` can empty an interval only when it is one version (`==1.2` vs `!=1.2`) or lies
    inside an excluded prefix (`==1.2.*` vs `!=1.2.*`); uv then says "unsatisfiable"."""
    if any(spec.operator == "===" for spec in specs):
        return False  # arbitrary equality compares strings: left to the literal test below
    if low is not None and high is not None and low[0] == high[0]:
        version = str(low[0])
        return not all(s.contains(version, prereleases=True) for s in sets)
    for spec in specs:
        if spec.operator == "!=" and spec.version.endswith(".*"):
            start, end = _spec_interval(Specifier("==" + spec.version))
            inside_low = low is not None and low[0] >= start[0]
            inside_high = high is not None and (
                high[0] < end[0] or (high[0] == end[0] and not high[1])
            )
            if inside_low and inside_high:
                return True
    return False


def exact_version(key: str) -> str | None:
    """`==0.6.18.post1` -> `0.6.18.post1`; anything that is not one exact version -> None."""
    specs = list(SpecifierSet(key))
    if len(specs) == 1 and specs[0].operator == "==" and not specs[0].version.endswith(".*"):
        return specs[0].version
    return None


def _interval(specs: list[Specifier]) -> tuple[Bound, Bound]:
    low: Bound = None
    high: Bound = None
    for spec in specs:
        lo, hi = _spec_interval(spec)
        low = _tighter(low, lo, upper=False)
        high = _tighter(high, hi, upper=True)
    return low, high


def _spec_interval(spec: Specifier) -> tuple[Bound, Bound]:
    op, text = spec.operator, spec.version
    if op in ("!=", "==="):
        return None, None
    if text.endswith(".*"):
        prefix = Version(text[:-2])
        return (Version(f"{text[:-2]}.dev0"), True), (_next_release(prefix.release), False)
    version = Version(text)
    if op == "==":
        return (version, True), (version, True)
    if op == "~=":
        return (version, True), (_next_release(version.release[:-1]), False)
    return {
        ">=": ((version, True), None),
        ">": ((version, False), None),
        "<=": (None, (version, True)),
        "<": (None, (version, False)),
    }[op]


def _next_release(release: tuple[int, ...]) -> Version:
    """(1, 2) -> 1.3.dev0: the first version above every 1.2.* (pre-releases included)."""
    bumped = release[:-1] + (release[-1] + 1,)
    return Version(".".join(map(str, bumped)) + ".dev0")


def _tighter(current: Bound, new: Bound, upper: bool) -> Bound:
    if new is None:
        return current
    if current is None:
        return new
    if current[0] != new[0]:
        pick_new = new[0] < current[0] if upper else new[0] > current[0]
        return new if pick_new else current
    return (current[0], current[1] and new[1])


def _nonempty(low: Bound, high: Bound) -> bool:
    if low is None or high is None:
        return True
    if low[0] != high[0]:
        return low[0] < high[0]
    return low[1] and high[1]


def _literals(*sets: SpecifierSet) -> list[str]:
    out = []
    for spec_set in sets:
        for spec in spec_set:
            text = spec.version.removesuffix(".*")
            try:
                Version(text)
            except InvalidVersion:
                continue
            out.append(text)
    return out
