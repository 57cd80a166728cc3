"""gitconfig.plain_records against real `git config -f FILE -z --list` (differential): for every
generated .gitmodules it reads, the same records in the same order, and only on files git reads
too; the plain form git writes (and the real NeMo-RL tree's files) must be read without git."""

from __future__ import annotations

import random
import subprocess
import tarfile

from real_tree import DATA

from rlflow.pins.gitconfig import plain_records

NAMES = ["a", "A b", "x]y", "\u00fc", "", "a.b", "sub/dir", 'a\\"b', "a\\\\b"]
HEADERS = [
    '[submodule "{}"]',
    '[Submodule "{}"]',
    '[SUBMODULE\t"{}"]',
    '[submodule  "{}"]',
    '[submodule"{}"]',
    '[submodule "{}"] ',
    ' [submodule "{}"]\t',
    '[submodule "{}" ]',
    '[submodule "{}"] # c',
    '[submodule "{}"] path = x',
    "[core]",
    "[x-Y]",
    "[a.b]",
    "[]",
    "[1abc]",
    "[ core]",
]
KEYS = ["path", "PATH", "url", "Url", "branch", "x-y", "1a", "-a", "a_b", "shallow"]
SEPARATORS = [" = ", "=", " =", "= ", "\t=\t", " ", ""]
VALUES = [
    "",
    "vendor/a",
    "a b",
    "a  b",
    "https://x/y.git",
    "a=b",
    "a # c",
    "a ; c",
    '"q"',
    "a\\tb",
    "a\\",
    "\u00fc",
    "a\tb",
    "  ",
    "../rel",
]
OTHER = ["", "   ", "# c", "; c", '\t# "x" \\', "junk", "\r", "\ufeff", "\x01", "\x7f"]


def line(pick, odd: bool) -> str:
    """One line: from the plain pieces only, or (`odd`) from all of them."""
    some = lambda pieces, plain: pick(pieces if odd else pieces[:plain])  # noqa: E731
    kind = pick("hhkkkkkkoo")
    if kind == "h":
        return some(HEADERS, 4).format(some(NAMES, 7))
    if kind == "k":
        blank = some(["", "\t", " ", "  \t"], 4)
        value = some(VALUES, 6) + some(["", "", " ", "\t"], 4)
        return blank + some(KEYS, 6) + some(SEPARATORS, 5) + value
    return some(OTHER, 4)


def git_says(tmp_path, text: str):
    path = tmp_path / "gitmodules"
    path.write_bytes(text.encode("utf-8"))
    done = subprocess.run(
        ["git", "config", "-f", str(path), "-z", "--list"], capture_output=True, check=False
    )
    if done.returncode != 0:
        return None
    out = done.stdout.decode("utf-8").split("\0")[:-1]
    return [tuple(record.partition("\n")[::2]) for record in out]


def test_plain_records_agree_with_git_config(tmp_path):
    pick = random.Random(1).choice
    read = 0
    for _ in range(900):
        lines = [pick(HEADERS[:2]).format(pick(NAMES[:4]))] if pick([True, False]) else []
        odd = pick([True, False, False])
        lines += [line(pick, odd) for _ in range(pick(range(1, 9)))]
        text = "\n".join(lines) + pick(["", "\n"])
        got = plain_records(text)
        if got is None:
            continue  # git reads it (or words its error)
        read += 1
        assert got == git_says(tmp_path, text), repr(text)
    assert read > 300, read  # the plain form was exercised, not only the fallback


def test_the_plain_form_is_read_without_git(tmp_path):
    for name in ("vendor/a", "3rdparty/Megatron-LM", "Automodel"):
        subprocess.run(
            ["git", "config", "-f", str(tmp_path / "gitmodules"), f"submodule.{name}.path", name],
            check=True,
        )
        subprocess.run(
            ["git", "config", "-f", str(tmp_path / "gitmodules"), f"submodule.{name}.url", "../x"],
            check=True,
        )
    written = (tmp_path / "gitmodules").read_text(encoding="utf-8")
    assert plain_records(written) == git_says(tmp_path, written)
    with tarfile.open(DATA) as archive:
        real = [m for m in archive.getmembers() if m.name.endswith(".gitmodules")]
        assert real
        for member in real:
            text = archive.extractfile(member).read().decode()
            assert plain_records(text) is not None, member.name
            assert plain_records(text) == git_says(tmp_path, text), member.name
