"""PEP 508 markers, compared by meaning the way uv compares them; pure.

uv rewrites every marker it locks (`python_version >= '3.10'` becomes `python_full_version >=
'3.10'`, clauses are reordered into a normal form, terms implied by `requires-python` drop out),
so two markers are "the same" when they hold in the same environments. `equivalent_sets` decides
that by evaluating both over every environment that can tell the literals apart: each literal of
each variable, one value none of them names, and for Python versions the points on and around
each bound, inside the project's `requires-python`. That grid is exact for the comparisons
markers can make.

`parse` raises ValueError on text that is not a marker; `TRUE` is the empty marker.
"""

from __future__ import annotations

import itertools
import re
from functools import lru_cache

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from rlflow.pins.pep508 import canonicalize_name

TRUE = ("and", ())
FALSE = ("or", ())
_PYTHON = ("python_version", "python_full_version")
# uv compares these as versions; `platform_release` is a string to uv (`>= '5'` is not `>= '5.0'`)
_VERSIONS = {"implementation_version"} | set(_PYTHON)
_TOKEN = re.compile(
    r"\s*(?:(?P<lp>\()|(?P<rp>\))|(?P<op>===|==|!=|<=|>=|~=|<|>|not\s+in\b|in\b)"
    r"|(?P<kw>and\b|or\b)|(?P<str>'[^']*'|\"[^\"]*\")|(?P<var>[A-Za-z_][A-Za-z0-9_.]*))"
)
_FLIP = {
    "<": ">",
    ">": "<",
    "<=": ">=",
    ">=": "<=",
    "==": "==",
    "!=": "!=",
    "~=": "~=",
    "===": "===",
}
_OTHER = "\x00other"
# uv knows these go together (`platform_system != 'Darwin'` is `sys_platform != 'darwin'`):
# (sys_platform, platform_system, os_name) of the platforms it models.
_PLATFORMS = (
    ("linux", "Linux", "posix"),
    ("darwin", "Darwin", "posix"),
    ("win32", "Windows", "nt"),
    ("freebsd", "FreeBSD", "posix"),
    ("cygwin", "CYGWIN_NT", "posix"),
)
_JOINT = ("sys_platform", "platform_system", "os_name")
MAX_GRID = 50_000


@lru_cache(maxsize=4096)
def parse(text: str | None):
    """Marker text -> a tree of ("and"|"or", children) and ("cmp", var, op, value, flipped)."""
    if text is None or not text.strip():
        return TRUE
    tokens = _tokens(text)
    tree, rest = _or(tokens, 0)
    if rest != len(tokens):
        raise ValueError(f"unexpected `{tokens[rest][1]}` in marker `{text}`")
    return tree


def both(a, b):
    """a and b."""
    return ("and", (a, b))


def either(items):
    return ("or", tuple(items))


def negate(tree):
    return ("not", tree)


def variables(tree) -> dict[str, set[str]]:
    """Variable -> the literals it is compared with."""
    out: dict[str, set[str]] = {}
    _collect(tree, out)
    return out


def satisfiable(tree, python: str | None = None) -> bool:
    grid = _grid([tree], python)
    return grid is None or any(_eval(tree, env) for env in grid)


def equivalent_sets(left: list, right: list, python: str | None = None) -> bool | None:
    """Do the two lists of markers hold the same *set* of truth tables? None: too many to tell."""
    return _equivalent_sets(tuple(left), tuple(right), python)


@lru_cache(maxsize=4096)
def _equivalent_sets(left: tuple, right: tuple, python: str | None) -> bool | None:
    # A workspace repeats its markers: on the NeMo-RL lock 176 comparisons are 65 distinct.
    if not left or not right:
        return not left and not right
    grid = _grid([*left, *right], python)
    if grid is None:
        return None
    table = lambda tree: tuple(_eval(tree, env) for env in grid)  # noqa: E731
    return {table(t) for t in left} == {table(t) for t in right}


def same(a, b, python: str | None = None) -> bool | None:
    return equivalent_sets([a], [b], python)


# -- parsing ----------------------------------------------------------------------------------
def _tokens(text: str) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(text):
        if text[i:].strip() == "":
            break
        match = _TOKEN.match(text, i)
        if not match or match.end() == i:
            raise ValueError(f"cannot read marker `{text}` at `{text[i : i + 20]}`")
        kind = match.lastgroup
        out.append((kind, re.sub(r"\s+", " ", match.group(kind))))
        i = match.end()
    return out


def _or(tokens, i):
    return _joined(tokens, i, "or", _and)


def _and(tokens, i):
    return _joined(tokens, i, "and", _atom)


def _joined(tokens, i, word, operand):
    """`operand (word operand)*` from tokens[i]: the one tree, or (word, trees) for several."""
    tree, i = operand(tokens, i)
    items = [tree]
    while i < len(tokens) and tokens[i] == ("kw", word):
        tree, i = operand(tokens, i + 1)
        items.append(tree)
    return (items[0] if len(items) == 1 else (word, tuple(items))), i


def _atom(tokens, i):
    if i >= len(tokens):
        raise ValueError("marker ends early")
    if tokens[i][0] == "lp":
        tree, i = _or(tokens, i + 1)
        if i >= len(tokens) or tokens[i][0] != "rp":
            raise ValueError("unbalanced `(` in marker")
        return tree, i + 1
    if i + 2 >= len(tokens):
        raise ValueError("incomplete marker comparison")
    left, op, right = tokens[i], tokens[i + 1], tokens[i + 2]
    if op[0] != "op" or {left[0], right[0]} != {"var", "str"}:
        raise ValueError("a marker compares one variable with one quoted string")
    if left[0] == "var":
        var, value, flipped = left[1], right[1][1:-1], False
    else:
        var, value, flipped = right[1], left[1][1:-1], True
    operator = op[1]
    if flipped and operator not in ("in", "not in"):
        operator, flipped = _FLIP[operator], False
    if var == "extra":
        value = canonicalize_name(value)
    return ("cmp", var, operator, value, flipped), i + 3


# -- evaluation -------------------------------------------------------------------------------
def _collect(tree, out: dict[str, set[str]], grid: bool = False) -> None:
    kind = tree[0]
    if kind == "cmp":
        var = "python" if tree[1] in _PYTHON else tree[1]
        values = out.setdefault(var, set())
        values.add(tree[3])
        if grid and tree[2] in ("in", "not in") and var not in _VERSIONS and var != "python":
            values |= _substring_points(tree[3], tree[4])
    elif kind == "not":
        _collect(tree[1], out, grid)
    else:
        for child in tree[1]:
            _collect(child, out, grid)


def _substring_points(literal: str, flipped: bool) -> set[str]:
    """Values that tell `in` from `==`: `'arm' in platform_machine` holds for `armv7l` too, and
    `platform_machine in 'x86_64 aarch64'` for `x86_64` alone (and for `86`)."""
    if flipped:
        return {f"{literal}\x01", f"\x01{literal}"}
    out = set(literal.split())
    if len(literal) > 1:
        out |= {literal[1:], literal[:-1]}
    return out


def _eval(tree, env: dict) -> bool:
    """The marker's value in `env`; loops, not all()/any() over generators: a lock's markers
    are evaluated over their whole grid, thousands of calls a check."""
    kind = tree[0]
    if kind == "and":
        for child in tree[1]:
            if not _eval(child, env):
                return False
        return True
    if kind == "or":
        for child in tree[1]:
            if _eval(child, env):
                return True
        return False
    if kind == "not":
        return not _eval(tree[1], env)
    _, var, op, value, flipped = tree
    have = env.get(var, "")
    if op in ("in", "not in"):
        inside = (have in value) if not flipped else (value in have)
        return inside if op == "in" else not inside
    if var in _VERSIONS:
        result = _version_cmp(have, op, value)
        if result is not None:
            return result
    if op == "==" or op == "===":
        return have == value
    if op == "!=":
        return have != value
    if op == "<":
        return have < value
    if op == "<=":
        return have <= value
    if op == ">":
        return have > value
    return op == ">=" and have >= value


@lru_cache(maxsize=65536)
def _version_cmp(have: str, op: str, value: str) -> bool | None:
    try:
        return Version(have) in SpecifierSet(f"{op}{value}", prereleases=True)
    except (InvalidVersion, InvalidSpecifier):
        return None


def _grid(trees: list, python: str | None) -> list[dict] | None:
    seen: dict[str, set[str]] = {}
    for tree in trees:
        _collect(tree, seen, grid=True)
    axes: list[tuple[str, list]] = []
    joint = [v for v in _JOINT if v in seen]
    if joint:
        values = set(_PLATFORMS)
        for i, var in enumerate(_JOINT):
            for literal in seen.get(var, ()):
                if not any(p[i] == literal for p in _PLATFORMS):
                    values.add(tuple(literal if j == i else _OTHER for j in range(3)))
        values.add((_OTHER, _OTHER, _OTHER))
        axes.append(("platform", sorted(values)))
    for var, literals in sorted(seen.items()):
        if var in _JOINT:
            continue
        if var == "python":
            axes.append((var, _python_points(literals, python)))
        elif var in _VERSIONS:
            axes.append((var, sorted(_version_points(literals))))
        else:
            axes.append((var, sorted(literals) + [_OTHER]))
    size = 1
    for _, values in axes:
        size *= max(len(values), 1)
    if size > MAX_GRID:
        return None
    grid = []
    for combo in itertools.product(*(values for _, values in axes)):
        env = {}
        for (var, _), value in zip(axes, combo, strict=True):
            if var == "python":
                env["python_full_version"] = value
                env["python_version"] = ".".join(value.split(".")[:2])
            elif var == "platform":
                env.update(zip(_JOINT, value, strict=True))
            else:
                env[var] = value
        grid.append(env)
    return grid


def _release(text: str) -> tuple[int, ...] | None:
    try:
        return Version(text.removesuffix(".*")).release
    except InvalidVersion:
        return None


def _version_points(literals) -> set[str]:
    points = set()
    for literal in literals:
        release = _release(literal)
        if release is None:
            points.add(literal)
            continue
        release = (release + (0, 0))[:3]
        for delta in (-1, 0, 1):
            last = release[-1] + delta
            if last >= 0:
                points.add(".".join(map(str, release[:-1] + (last,))))
    return points or {"0"}


def _python_points(literals, python: str | None) -> list[str]:
    bounds = set(literals)
    if python:
        bounds |= {spec.version for spec in SpecifierSet(python)}
    points = set()
    for literal in bounds:
        release = _release(literal)
        if release is None:
            continue
        major, minor, micro = (release + (0, 0))[:3]
        for m, n, p in (
            (major, minor, micro),
            (major, minor, micro + 1),
            (major, minor, max(micro - 1, 0)),
            (major, minor, 0),
            (major, minor, 99),
            (major, minor + 1, 0),
            (major, max(minor - 1, 0), 99),
        ):
            points.add(f"{m}.{n}.{p}")
    if python:
        domain = SpecifierSet(python)
        points = {p for p in points if domain.contains(p, prereleases=True)}
    return sorted(points, key=Version) or ["3.12.0"]
