"""A CI command line -> the pytest invocations in it, read as the shell reads it.

`shlex` splits words and quotes like sh; `&&`, `||`, `;`, `|` and `&` separate commands; a
`cd DIR` changes the directory of the commands after it; `NAME=value` prefixes and `env` set
variables; `timeout`, `time`, `nice`, `exec`, `xvfb-run`, `uv run [options]`, `python -m`,
`coverage run -m` run the command they are given. What is left after `pytest` (up to a
redirection or the end of the command) are pytest's own arguments, for pytest's own parser.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass

_SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "|&"}
_REDIRECT = re.compile(r"^(\d*)(>>?|<|>&|&>|<&)$")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# uv options that take a value (so the value is not the command)
_UV_VALUE = {
    "--extra", "--group", "--with", "--with-requirements", "--with-editable", "--python", "-p",
    "--directory", "--project", "--package", "--index", "--default-index", "--find-links",
    "-f", "--env-file", "--only-group", "--no-group", "--exclude-newer", "--config-file",
    "--cache-dir", "--prerelease", "--resolution", "--index-url", "--extra-index-url",
}  # fmt: skip
_WRAPPERS_WITH_VALUE = {"timeout": 1, "nice": 0, "time": 0, "exec": 0, "command": 0}


@dataclass(frozen=True)
class Invocation:
    args: tuple[str, ...]
    cwd: str  # relative to the repository root, "" for the root
    env: tuple[tuple[str, str], ...]


def words(line: str) -> list[str]:
    """Shell words; raises ValueError on an unbalanced quote."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def invocations(lines: list[str], cwd: str = "") -> list[tuple[int, Invocation]]:
    """(index of the line, invocation) for every pytest run in a script's logical lines."""
    out = []
    for number, line in enumerate(lines):
        try:
            tokens = words(line)
        except ValueError as err:
            raise ValueError(f"cannot split `{line.strip()[:80]}` into words: {err}") from None
        for command in _commands(tokens):
            if command[:1] == ["cd"]:
                target = command[1] if len(command) > 1 else ""
                cwd = "" if target in ("", "~") else posixpath.normpath(posixpath.join(cwd, target))
                continue
            found = _pytest(command, cwd)
            if found is not None:
                out.append((number, found))
    return out


def _commands(tokens: list[str]) -> list[list[str]]:
    out, current, skip = [], [], False
    for token in tokens:
        if skip:
            skip = False
            continue
        if token in _SEPARATORS:
            out.append(current)
            current = []
            continue
        redirect = _REDIRECT.match(token)
        if redirect:
            if current and current[-1].isdigit():
                current.pop()
            skip = True
            continue
        current.append(token)
    out.append(current)
    return [c for c in out if c]


def _pytest(command: list[str], cwd: str) -> Invocation | None:
    env, i = [], 0
    while i < len(command):
        word = command[i]
        if _ASSIGN.match(word):
            name, _, value = word.partition("=")
            env.append((name, value))
            i += 1
        elif word == "env":
            i += 1
            while i < len(command) and (command[i].startswith("-") or _ASSIGN.match(command[i])):
                if _ASSIGN.match(command[i]):
                    name, _, value = command[i].partition("=")
                    env.append((name, value))
                i += 1
        elif word in _WRAPPERS_WITH_VALUE:
            i += 1
            while i < len(command) and command[i].startswith("-"):
                i += 1 + (command[i] in ("-s", "--signal", "-k", "--kill-after", "-n"))
            i += _WRAPPERS_WITH_VALUE[word]
        elif word == "xvfb-run":
            i += 1
            while i < len(command) and command[i].startswith("-"):
                i += 1
        elif word == "uv" and command[i + 1 : i + 2] == ["run"]:
            i += 2
            while i < len(command) and command[i].startswith("-"):
                option = command[i].split("=", 1)[0]
                if option in ("--directory", "--project") and "=" not in command[i]:
                    cwd = posixpath.normpath(posixpath.join(cwd, command[i + 1]))
                i += 1 + (option in _UV_VALUE and "=" not in command[i])
        elif re.fullmatch(r"(.*/)?python[0-9.]*", word):
            i += 1
            while i < len(command) and command[i].startswith("-") and command[i] != "-m":
                i += 1 + (command[i] in ("-X", "-W"))
            if command[i : i + 2] in (["-m", "pytest"], ["-m", "py.test"]):
                return Invocation(tuple(command[i + 2 :]), cwd, tuple(env))
            return None
        elif word == "coverage" and command[i + 1 : i + 2] == ["run"]:
            i += 2
            while i < len(command) and command[i].startswith("-") and command[i] != "-m":
                i += 1
            if command[i : i + 2] == ["-m", "pytest"]:
                return Invocation(tuple(command[i + 2 :]), cwd, tuple(env))
            return None
        elif word.rsplit("/", 1)[-1] in ("pytest", "py.test"):
            return Invocation(tuple(command[i + 1 :]), cwd, tuple(env))
        else:
            return None
    return None
