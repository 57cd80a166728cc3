"""PEP 508 requirement strings, parsed once each; the usual forms without packaging's parser.

Most requirements in a pyproject are `name`, `name[extras]` or `name>=1.2,<2`, some with a URL
(`name @ https://...`) or a marker (`; sys_platform == 'linux' and (...)`). For those, regexes
split the text, packaging's `SpecifierSet` checks and holds the specifiers, and the marker is
written the way packaging's `Marker` writes it (`str(requirement.marker)`): the same name,
extras, URL, specifier and marker text packaging's `Requirement` gives, for a fraction of its
time (its tokenizer is ~60 us a requirement, and importing packaging.requirements, its markers
and `packaging.utils` -> `tags` -> `logging` costs a tenth of a check). Anything else (another
marker variable, a quote or escape inside a marker value, any other whitespace), and anything
`SpecifierSet` refuses, goes to packaging's `Requirement`, so its errors (`InvalidRequirement`)
are packaging's own. Parsed requirements are shared: treat them as read-only.
"""

from __future__ import annotations

import re
from functools import cache
from typing import TYPE_CHECKING

from packaging.specifiers import InvalidSpecifier, SpecifierSet

if TYPE_CHECKING:
    from packaging.requirements import Requirement

__all__ = ["Plain", "canonicalize_name", "parse", "spec_words"]  # and, lazily, packaging's
# InvalidRequirement, Requirement and `Parsed` (module __getattr__)

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_SPEC = r"(?:===|==|!=|<=|>=|~=|<|>)[A-Za-z0-9.*+!_-]+"
_B = "[ \t]*"  # packaging's blanks; a newline or other whitespace goes to its parser (an error)
_HEAD = (
    rf"{_B}(?P<name>{_NAME}){_B}"
    rf"(?:\[{_B}(?P<extras>{_NAME}(?:{_B},{_B}{_NAME})*){_B}\]{_B})?"
)
_PLAIN = re.compile(
    rf"{_HEAD}(?P<spec>{_SPEC}(?:{_B},{_B}{_SPEC})*)?{_B}(?:;(?P<marker>.*))?", re.DOTALL
)
_URL = re.compile(rf"{_HEAD}@{_B}(?P<url>\S+)(?:[ \t]+(?:;(?P<marker>.*))?)?", re.DOTALL)
_COMMA = re.compile(rf"{_B},{_B}")
# The marker variables packaging writes back as they are (no alias, no set-valued ones).
_VARIABLE = (
    r"python_version|python_full_version|os_name|sys_platform|platform_release|platform_system"
    r"|platform_version|platform_machine|platform_python_implementation|implementation_name"
    r"|implementation_version"
)
_MARKER_TOKEN = re.compile(
    r"[ \t]*(?:(?P<open>\()|(?P<close>\))|(?P<bool>\b(?:and|or)\b)"
    r"|(?P<op>===|==|~=|!=|<=|>=|<|>|\bnot[ \t]+in\b|\bin\b)"
    rf"|(?P<var>\b(?:{_VARIABLE})\b)|'(?P<sq>[^'\"\\]*)'|\"(?P<dq>[^'\"\\]*)\")"
)


def canonicalize_name(name: str) -> str:
    """packaging.utils.canonicalize_name (PEP 503), without importing packaging.utils."""
    value = name.lower().replace("_", "-").replace(".", "-")
    while "--" in value:
        value = value.replace("--", "-")
    return value


class Plain:
    """What packaging's `Requirement` holds for a requirement of the usual forms, and the
    words of its specifier (`spec_words`). `marker` is the marker's text as packaging writes it."""

    __slots__ = ("name", "extras", "specifier", "words", "url", "marker")

    def __init__(self, name, extras, spec, url=None, marker=None):
        self.name, self.extras, self.url, self.marker = name, extras, url, marker
        self.specifier, self.words = spec[0], spec[1:]

    def __str__(self) -> str:
        extras = f"[{','.join(sorted(self.extras))}]" if self.extras else ""
        text = f"{self.name}{extras}{self.specifier}"
        if self.url:
            text += f" @ {self.url}" + (" " if self.marker else "")
        return text + (f"; {self.marker}" if self.marker else "")


def __getattr__(name: str):
    """packaging's Requirement (and its error, and `Parsed`), imported when first needed."""
    if name in ("Requirement", "InvalidRequirement"):
        from packaging import requirements

        return getattr(requirements, name)
    if name == "Parsed":
        from packaging.requirements import Requirement

        return Plain | Requirement
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@cache
def parse(text: str) -> Plain | Requirement:
    """`text` as packaging reads it; raises InvalidRequirement as packaging does."""
    parsed = _fast(text)
    if parsed is not None:
        return parsed
    from packaging.requirements import Requirement

    return Requirement(text)


def _fast(text: str) -> Plain | None:
    match = _PLAIN.fullmatch(text)
    url = None
    if match is None:
        match = _URL.fullmatch(text)
        if match is None:
            return None
        url = match.group("url")
    marker = match.group("marker")
    if marker is not None:
        marker = _marker(marker)
        if marker is None:
            return None
    extras = match.group("extras")
    try:
        spec = _specifier("" if url else match.group("spec") or "")
    except InvalidSpecifier:
        return None  # packaging's own parser words the error
    return Plain(
        match.group("name"), set(_COMMA.split(extras)) if extras else set(), spec, url, marker
    )


def _marker(text: str) -> str | None:
    """The marker as `str(packaging.markers.Marker(text))` writes it, or None when it is not
    of the forms read here."""
    tokens, at = [], 0
    while at < len(text):
        match = _MARKER_TOKEN.match(text, at)
        if match is None:
            if text[at:].strip(" \t"):
                return None
            break
        at = match.end()
        kind = match.lastgroup
        if kind in ("sq", "dq"):
            value = match.group(kind)
            if not value.isprintable():
                return None  # packaging reads it with ast.literal_eval
            tokens.append(("value", f'"{value}"'))
        elif kind == "op":
            tokens.append(
                ("op", "not in" if match.group(kind).startswith("not") else match.group(kind))
            )
        else:
            tokens.append((kind, match.group(kind)))
    tree, end = _expression(tokens, 0, 0)
    if tree is None or end != len(tokens):
        return None
    return _format(tree)


def _expression(tokens: list, i: int, depth: int):
    """marker = atom (and|or atom)*: packaging's tree, a list of items, words and sub-lists."""
    atom, i = _atom(tokens, i, depth)
    if atom is None:
        return None, i
    tree = [atom]
    while i < len(tokens) and tokens[i][0] == "bool":
        right, j = _atom(tokens, i + 1, depth)
        if right is None:
            return None, j
        tree += [tokens[i][1], right]
        i = j
    return tree, i


def _atom(tokens: list, i: int, depth: int):
    if i < len(tokens) and tokens[i][0] == "open":
        if depth >= 16:
            return None, i  # packaging's own limit and error
        tree, i = _expression(tokens, i + 1, depth + 1)
        if tree is None or i >= len(tokens) or tokens[i][0] != "close":
            return None, i
        return tree, i + 1
    kinds = tuple(t[0] for t in tokens[i : i + 3])
    if kinds not in (("var", "op", "value"), ("value", "op", "var")):
        return None, i
    return tuple(t[1] for t in tokens[i : i + 3]), i + 3


def _format(tree, first: bool = True) -> str:
    """packaging.markers._format_marker, on the same tree."""
    if isinstance(tree, tuple):
        return " ".join(tree)
    if isinstance(tree, str):
        return tree
    if len(tree) == 1 and isinstance(tree[0], list | tuple):
        return _format(tree[0], first)
    inner = " ".join(_format(t, first=False) for t in tree)
    return inner if first else f"({inner})"


_URL_THEN_WORDS = re.compile(rf"{_HEAD}@{_B}\S+[ \t]+[^;\s]", re.DOTALL)


def rejects_url_marker(text: str) -> bool:
    """True for `name @ URL; marker` with the `;` against the URL, which packaging refuses
    (its URL is every non-blank character, so `;` is part of it and a marker must follow
    another `;`) and uv accepts; the caller then reads it as uv does, without packaging."""
    return _URL_THEN_WORDS.match(text) is not None


def spec_words(parsed: Plain | Requirement) -> tuple[str, str]:
    """(key, display) of the requirement's specifier: the sorted specifiers, and packaging's
    text of the set."""
    if isinstance(parsed, Plain):
        return parsed.words
    return _words(parsed.specifier)


@cache
def _specifier(text: str) -> tuple[SpecifierSet, str, str]:
    """One shared (read-only) SpecifierSet and its words per text: a tree repeats its
    specifiers, and 20,000 requirements spent a third of their time building them."""
    spec = SpecifierSet(text)
    return (spec, *_words(spec))


def _words(spec: SpecifierSet) -> tuple[str, str]:
    return ",".join(sorted(str(s) for s in spec)), str(spec)
