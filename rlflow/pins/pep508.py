"""PEP 508 requirement strings, parsed once each; the plain form without packaging's parser.

Most requirements in a pyproject are `name`, `name[extras]` or `name>=1.2,<2` (no URL, no
marker). For those, a regex splits the text and packaging's `SpecifierSet` checks and holds the
specifiers: the same name, extras and specifier packaging's `Requirement` gives, for a fifth of
its time (its tokenizer is ~60 us a requirement; 20,000 of them were most of a second).
Anything else, and anything the regex accepts but `SpecifierSet` refuses, goes to packaging's
`Requirement`, so its errors (`InvalidRequirement`) are packaging's own. Parsed requirements
are shared: treat them as read-only.
"""

from __future__ import annotations

import re
from functools import cache

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet

__all__ = ["InvalidRequirement", "Parsed", "Plain", "parse"]

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_SPEC = r"(?:===|==|!=|<=|>=|~=|<|>)[A-Za-z0-9.*+!_-]+"
_B = "[ \t]*"  # packaging's blanks; a newline or other whitespace goes to its parser (an error)
_PLAIN = re.compile(
    rf"{_B}(?P<name>{_NAME}){_B}"
    rf"(?:\[{_B}(?P<extras>{_NAME}(?:{_B},{_B}{_NAME})*){_B}\]{_B})?"
    rf"(?P<spec>{_SPEC}(?:{_B},{_B}{_SPEC})*)?{_B}"
)
_COMMA = re.compile(rf"{_B},{_B}")


class Plain:
    """What packaging's `Requirement` holds for a requirement without URL or marker, and the
    words of its specifier (`spec_words`)."""

    __slots__ = ("name", "extras", "specifier", "words")
    url = None
    marker = None

    def __init__(self, name: str, extras: set[str], spec: tuple[SpecifierSet, str, str]):
        self.name, self.extras = name, extras
        self.specifier, self.words = spec[0], spec[1:]

    def __str__(self) -> str:
        extras = f"[{','.join(sorted(self.extras))}]" if self.extras else ""
        return f"{self.name}{extras}{self.specifier}"


Parsed = Plain | Requirement


@cache
def parse(text: str) -> Parsed:
    """`text` as packaging reads it; raises InvalidRequirement as packaging does."""
    match = _PLAIN.fullmatch(text)
    if match is not None:
        extras = match.group("extras")
        try:
            spec = _specifier(match.group("spec") or "")
        except InvalidSpecifier:
            pass  # packaging's own parser words the error
        else:
            return Plain(match.group("name"), set(_COMMA.split(extras)) if extras else set(), spec)
    return Requirement(text)


def spec_words(parsed: Parsed) -> tuple[str, str]:
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
