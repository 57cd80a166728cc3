"""pep508.parse against packaging's own Requirement (differential): every requirement string of
the real NeMo-RL tree, and generated ones of the plain shape (names, extras, specifiers, blanks,
valid and not), must give the same name, extras, URL, specifier and marker, or the same error."""

from __future__ import annotations

import random
import re
import tarfile

from packaging.requirements import InvalidRequirement, Requirement
from real_tree import DATA

from rlflow.pins import pep508

NAMES = ["a", "A1", "foo-bar", "Foo_Bar", "x.y", "a-", "_a", "a..b", "torch", "1"]
OPERATORS = ["==", ">=", "<=", "~=", "!=", "<", ">", "===", "=", "=>", ""]
VERSIONS = ["1", "1.0", "1.0.*", "2.6.0rc1", "1.0+local", "1!2.0", "v1", "1.0.post1", "abc", "1.*"]
BLANKS = ["", " ", "  ", "\t", "\n", "\r", "\x0c", "\xa0"]


def corpus() -> set[str]:
    texts = set()
    with tarfile.open(DATA) as archive:
        for member in archive.getmembers():
            if member.name.endswith("pyproject.toml"):
                text = archive.extractfile(member).read().decode()
                texts |= set(re.findall(r'"([^"\n]*)"', text))
    pick = random.Random(508).choice
    for _ in range(20_000):
        text = pick(BLANKS) + pick(NAMES) + pick(BLANKS)
        if pick((True, False)):
            extras = random.Random(len(texts)).sample(NAMES, int(pick("0123")))
            text += "[" + pick(BLANKS) + ("," + pick(BLANKS)).join(extras) + pick(BLANKS) + "]"
        for k in range(int(pick("0123"))):
            text += ("," + pick(BLANKS) if k else "") + pick(OPERATORS) + pick(["", " "])
            text += pick(VERSIONS) + pick(BLANKS)
        texts.add(text + pick(["", "", ";", " ; python_version<'3.12'", " @ https://x/y.whl"]))
    return texts


def packaging_says(text: str):
    try:
        return Requirement(text)
    except InvalidRequirement as err:
        return str(err)


def parse_agreeing(text: str, want=None):
    """pep508.parse(text), asserted to give what packaging gives: the same error (then None),
    or the same name, extras, URL, specifier, marker and text."""
    want = packaging_says(text) if want is None else want
    try:
        got = pep508.parse(text)
    except InvalidRequirement as err:
        got = str(err)
    if isinstance(want, str) or isinstance(got, str):
        assert want == got, text
        return None
    assert (got.name, got.extras, got.url) == (want.name, want.extras, want.url), text
    assert (str(got.specifier), str(got.marker)) == (str(want.specifier), str(want.marker)), text
    assert str(got) == str(want), text
    return got


def test_pep508_parse_agrees_with_packaging():
    plain = 0
    for text in sorted(corpus()):
        plain += isinstance(parse_agreeing(text), pep508.Plain)
    assert plain > 500, plain  # the fast path was exercised, not only the fallback


VARIABLES = [
    "python_version",
    "sys_platform",
    "platform_machine",
    "extra",
    "os.name",
    "python_implementation",
    "implementation_name",
    "platform_python_implementation",
]
MARKER_OPS = ["==", "!=", ">=", "<", "===", "~=", "in", "not in", "not  in", "=", "is"]
VALUES = [
    "'linux'",
    '"3.12"',
    "'x86_64'",
    "''",
    "'a b'",
    "'Foo_Bar'",
    "'it\"s'",
    "'\\x41'",
    "'3.*'",
]


def markers(pick, depth: int = 0) -> str:
    """A random marker expression: items, and/or, parentheses, blanks; valid and not."""
    if depth < 2 and pick((True, False, False)):
        inner = markers(pick, depth + 1)
        return pick(["(", "( ", "(("]) + inner + pick([")", " )", "))", ""])
    left, right = pick(VARIABLES), pick(VALUES)
    if pick((True, False, False, False)):
        left, right = right, left
    item = left + pick(BLANKS[:4]) + pick(MARKER_OPS) + pick(BLANKS[:4]) + right
    if depth < 3 and pick((True, False)):
        item += pick([" and ", " or ", "and ", " or", " AND "]) + markers(pick, depth + 1)
    return item


def test_pep508_markers_and_urls_agree_with_packaging():
    """The marker and URL forms the fast path reads, and their near misses."""
    pick = random.Random(685).choice
    fast = 0
    for _ in range(10_000):
        head = pick(["a", "Foo_Bar[x]", "torch>=2.6", "t [a,b] ==1.0", "flash-attn"])
        if pick((True, False)):
            head = head.split(">")[0].split("=")[0] + pick([" @ ", "@", " @"])
            head += pick(["https://x/y.whl", "git+https://g/r.git@v1#egg=r", "file:///a b"])
        text = head + pick(["", " ", "\t"]) + pick([";", " ;", "; ", ""]) + markers(pick)
        text += pick(["", " ", "\n", "\t"])
        want = packaging_says(text)
        if pep508.rejects_url_marker(text):  # lowering.py then skips asking packaging
            assert isinstance(want, str), text
        got = parse_agreeing(text, want)
        fast += isinstance(got, pep508.Plain) and got.marker is not None
    assert fast > 500, fast  # the fast path read markers, not only the fallback
