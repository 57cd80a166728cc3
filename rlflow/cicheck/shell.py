"""A CI command line -> the pytest invocations in it, read as the shell reads it.

`shlex` splits words and quotes like sh; `&&`, `||`, `;`, `|` and `&` separate commands, `( )`
is a subshell (a `cd` inside ends with it), `if`/`then`/`do`/`{` and the like start a command;
`cd DIR`, `cd -`, `pushd`/`popd` change the directory of the commands after them; `NAME=value`
prefixes, `env` and `export` set variables; `timeout`, `time`, `nice`, `exec`, `xvfb-run`,
`sudo`, `uv run [options]`, `poetry run`, `pipenv run`, `pdm run`, `conda run`, `python -m`,
`coverage run -m` run the command they are given, and `bash -c '...'` (`-lc`, `-euo pipefail
-c`) is read as the line it runs. What is left after `pytest` (up to a redirection or the end
of the command) are pytest's own arguments, for pytest's own parser.

Besides pytest runs, a line may run a script (`bash x.sh`, `./x.sh`: ScriptCall), make targets
(MakeCall) or a runner check-tests does not follow (`tox`, `nox`...: Runner); and a command
that runs pytest in a way this module does not follow (`docker run img pytest`, pytest after a
`cd $DIR`) is Unknown: check-tests says it cannot tell, it never guesses.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass

_SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "|&", "\n"}
_OPERATORS = ("<<<", "<<-", "&&", "||", ";;", "|&", ">>", "<<", "&>", ">&", "<&", ";", "&", "|")
_OPERATORS += ("<", ">", "(", ")")
_PUNCTUATION = set(";&|<>()")
_REDIRECT = re.compile(r"^(\d*)(>>?|<|>&|&>|<&|<<-?|<<<)$")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# a word that starts a command but is not one (`if pytest ...; then pytest ...; fi`)
_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}"}
# uv options that take a value (so the value is not the command)
_UV_VALUE = {
    "--extra", "--group", "--with", "--with-requirements", "--with-editable", "--python", "-p",
    "--directory", "--project", "--package", "--index", "--default-index", "--find-links",
    "-f", "--env-file", "--only-group", "--no-group", "--exclude-newer", "--config-file",
    "--cache-dir", "--prerelease", "--resolution", "--index-url", "--extra-index-url",
    "--from",
}  # fmt: skip
_WRAPPERS_WITH_VALUE = {"timeout": 1, "nice": 0, "time": 0, "exec": 0, "command": 0}
_SUDO_VALUE = {"-u", "--user", "-g", "--group", "-C", "-D", "--chdir", "-h", "--host"}
_MAKE_VALUE = {"-C", "--directory", "-f", "--file", "--makefile", "-j", "--jobs", "-l", "-o", "-W"}
_SHELLS = {"bash", "sh", "zsh", "dash", "source", "."}
# tools that run commands from their own configuration, which check-tests does not read
RUNNERS = {"tox", "nox", "just", "invoke", "inv", "task", "poe", "hatch"}
# commands that name pytest without running it
_NOT_RUNS = {
    "echo", "printf", "which", "type", "hash", "grep", "cat", "test", "[", "[[", "rm", "ls",
    "git", "cp", "mv", "mkdir", "touch", "chmod", "chown", "curl", "wget", "tar", "ln", "sed",
    "awk", "head", "tail", "tee", "du", "wc", "diff", "sort",
}  # fmt: skip
_NOT_RUNS_VERBS = {
    "install", "add", "uninstall", "remove", "show", "list", "freeze", "download", "sync",
    "lock", "export", "tree", "cache", "venv", "build", "publish", "upgrade", "update", "check",
}  # fmt: skip
# pytest named as a command inside a word (`sh -c "pytest x"`), not `pytest-cov`
_PYTEST_IN = re.compile(r"(^|[\s;&|(])(py\.?test|python[0-9.]* -m pytest)(?=[\s;&|)]|$)")
# `cd` targets that are the repository root in CI
_ROOT_VARS = ("$GITHUB_WORKSPACE", "${GITHUB_WORKSPACE}", "$CI_PROJECT_DIR", "${CI_PROJECT_DIR}")
_SCRIPT_DIR = re.compile(
    r"""^\$\((?:dirname|cd)\s+"?\$(?:0|\{0\}|\{BASH_SOURCE(?:\[0\])?\}|BASH_SOURCE)"?\s*\)"""
    r"""|^\$\{(?:0|BASH_SOURCE(?:\[0\])?)%/\*\}"""
)


@dataclass(frozen=True)
class Invocation:
    args: tuple[str, ...]
    cwd: str  # relative to the repository root, "" for the root
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ScriptCall:
    path: str  # as written, relative to cwd
    cwd: str
    env: tuple[tuple[str, str], ...]
    command: str = ""  # for a script that is not sh (`python x.py`): the command that runs it


@dataclass(frozen=True)
class MakeCall:
    targets: tuple[str, ...]  # () = the default goal
    makefile: str  # "-f FILE" as written, relative to cwd; "" = make's own lookup
    cwd: str  # the directory make runs in (after -C)
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Runner:
    tool: str  # tox, nox, ...: check-tests cannot follow what it runs
    command: str


@dataclass(frozen=True)
class Unknown:
    command: str
    why: str


Found = Invocation | ScriptCall | MakeCall | Runner | Unknown


def words(line: str) -> list[str]:
    """Shell words and operators; raises ValueError on an unbalanced quote. `$( ... )` (and
    `$(( ))`) stays one word, so a command substitution is never read as a subshell."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    raw = list(lexer)
    out: list[str] = []
    for token in raw:
        if token and set(token) <= _PUNCTUATION:
            out += _split_operators(token)
        else:
            out.append(token)
    merged: list[str] = []
    i = 0
    while i < len(out):
        token = out[i]
        if token.endswith("$") and out[i + 1 : i + 2] == ["("]:
            depth, j, parts = 0, i + 1, [token]
            while j < len(out):
                depth += (out[j] == "(") - (out[j] == ")")
                parts.append(out[j])
                j += 1
                if depth == 0:
                    break
            merged.append(
                " ".join(parts).replace("$ (", "$(").replace("( ", "(").replace(" )", ")")
            )
            i = j
            continue
        merged.append(token)
        i += 1
    return merged


def _split_operators(token: str) -> list[str]:
    out = []
    while token:
        for op in _OPERATORS:
            if token.startswith(op):
                out.append(op)
                token = token[len(op) :]
                break
    return out


@dataclass
class _State:
    cwd: str | None  # None: a directory check-tests cannot tell (`cd $DIR`)
    why: str  # why cwd is None
    env: dict[str, str]
    old: str | None = None  # `cd -`
    dirs: list | None = None  # pushd's stack


def invocations(
    lines: list[str], cwd: str = "", env: tuple = (), script_dir: str | None = None
) -> list[tuple[int, Found]]:
    """(index of the line, what it runs) for every pytest run, script call, make call, runner
    and unfollowable pytest run in a script's logical lines (one shell: `cd` and `export`
    carry over from line to line)."""
    state = _State(cwd, "", dict(env), None, [])
    stack: list[tuple] = []  # subshells: the state to restore at `)`
    out: list[tuple[int, Found]] = []
    for number, line in enumerate(lines):
        try:
            tokens = words(line)
        except ValueError as err:
            raise ValueError(f"cannot split `{line.strip()[:80]}` into words: {err}") from None
        for command in _commands(tokens):
            if command == ["("]:
                stack.append((state.cwd, state.why, dict(state.env), state.old, list(state.dirs)))
                continue
            if command == [")"]:
                if stack:
                    state.cwd, state.why, state.env, state.old, state.dirs = stack.pop()
                continue
            for found in _command(command, state, script_dir):
                out.append((number, found))
    return out


def _commands(tokens: list[str]) -> list[list[str]]:
    out, current, skip = [], [], False
    for token in tokens:
        if skip:
            skip = False
            continue
        if token in _SEPARATORS or token in ("(", ")"):
            out.append(current)
            current = []
            if token in ("(", ")"):
                out.append([token])
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


def _norm(path: str) -> str:
    resolved = posixpath.normpath(path) if path else "."
    return "" if resolved == "." else resolved


def _chdir(state: _State, target: str | None, script_dir: str | None) -> None:
    here = state.cwd
    if target == "-":
        state.cwd, state.why = state.old, "`cd -` to a directory check-tests cannot tell"
        state.old = here
        return
    known = False  # an absolute path that is the repository (a CI variable, the script's dir)
    for var in _ROOT_VARS:
        if target is not None and (target == var or target.startswith(var + "/")):
            target, known = "/" + target[len(var) :].lstrip("/"), True
            break
    match = _SCRIPT_DIR.match(target or "")
    if match and script_dir is not None:
        target, known = "/" + posixpath.join(script_dir, target[match.end() :].lstrip("/")), True
    if target is None or target == "~" or target.startswith("~/"):
        state.cwd, state.why = None, f"`cd {target or ''}` goes to the home directory"
    elif "$" in target or "`" in target or "*" in target:
        state.cwd, state.why = None, f"`cd {target}` is a shell expression"
    elif target.startswith("/") and not known:
        state.cwd, state.why = None, f"`cd {target}` is outside the repository"
    elif state.cwd is None and not known:
        pass  # relative to a directory already unknown
    else:
        resolved = _norm(posixpath.join("" if known else state.cwd, target.lstrip("/")))
        if resolved == ".." or resolved.startswith("../"):
            state.cwd, state.why = None, f"`cd {target}` leaves the repository"
        else:
            state.cwd = resolved
    state.old = here


def _env_words(command: list[str], i: int, env: list) -> int:
    while i < len(command) and _ASSIGN.match(command[i]):
        name, _, value = command[i].partition("=")
        env.append((name, value))
        i += 1
    return i


def _command(command: list[str], state: _State, script_dir: str | None) -> list[Found]:
    text = " ".join(command)
    while command and command[0] in _KEYWORDS:
        command = command[1:]
    if not command or command[0] in ("for", "case", "select", "function", "in", "esac"):
        return []
    head = command[0]
    if head in ("cd", "pushd", "popd"):
        _directory(command, state, script_dir)
        return []
    if head == "export":
        for word in command[1:]:
            if _ASSIGN.match(word):
                name, _, value = word.partition("=")
                state.env[name] = value
        return []
    env: list = list(state.env.items())
    cwd = state.cwd
    i = _env_words(command, 0, env)
    if i == len(command):  # `NAME=value` alone: a shell variable; exported ones change
        for name, value in env[len(state.env) :]:
            if name in state.env:
                state.env[name] = value
        return []
    while i < len(command):
        word = command[i]
        if _ASSIGN.match(word):
            i = _env_words(command, i, env)
        elif word == "env":
            i += 1
            while i < len(command) and (command[i].startswith("-") or _ASSIGN.match(command[i])):
                if _ASSIGN.match(command[i]):
                    name, _, value = command[i].partition("=")
                    env.append((name, value))
                i += 1
        elif word == "command" and command[i + 1 : i + 2] in (["-v"], ["-V"]):
            return []  # `command -v pytest` looks pytest up, it does not run it
        elif word in _WRAPPERS_WITH_VALUE:
            i += 1
            while i < len(command) and command[i].startswith("-"):
                i += 1 + (command[i] in ("-s", "--signal", "-k", "--kill-after", "-n"))
            i += _WRAPPERS_WITH_VALUE[word]
        elif word == "xvfb-run":
            i += 1
            while i < len(command) and command[i].startswith("-"):
                i += 1 + (command[i] in ("-n", "-s", "-e", "-f", "-p", "-w"))
        elif word == "sudo":
            i += 1
            while i < len(command) and command[i].startswith("-"):
                i += 1 + (command[i] in _SUDO_VALUE)
        elif (
            (word == "uv" and command[i + 1 : i + 2] == ["run"])
            or word == "uvx"
            or (word == "uv" and command[i + 1 : i + 3] == ["tool", "run"])
        ):
            i += 1 if word == "uvx" else 2 if command[i + 1] == "run" else 3
            while i < len(command) and command[i].startswith("-"):
                option = command[i].split("=", 1)[0]
                if option == "--directory" and cwd is not None:  # --project keeps the cwd
                    value = command[i + 1] if "=" not in command[i] else command[i].split("=", 1)[1]
                    cwd = _norm(posixpath.join(cwd, value))
                i += 1 + (option in _UV_VALUE and "=" not in command[i])
        elif word in ("poetry", "pipenv", "pdm", "rye") and command[i + 1 : i + 2] == ["run"]:
            i += 2
        elif word in ("conda", "mamba", "micromamba") and command[i + 1 : i + 2] == ["run"]:
            i += 2
            while i < len(command) and command[i].startswith("-"):
                option, _, value = command[i].partition("=")
                takes = option in ("-n", "--name", "-p", "--prefix", "--cwd") and not value
                value = command[i + 1] if takes and i + 1 < len(command) else value
                if option == "--cwd" and cwd is not None:
                    cwd = _norm(posixpath.join(cwd, value))
                i += 1 + takes
        elif re.fullmatch(r"(.*/)?python[0-9.]*", word):
            i += 1
            while (
                i < len(command) and command[i].startswith("-") and command[i] not in ("-m", "-c")
            ):
                i += 1 + (command[i] in ("-X", "-W"))
            if command[i : i + 2] in (["-m", "pytest"], ["-m", "py.test"]):
                return [_pytest(command[i + 2 :], cwd, env, state, text)]
            if command[i : i + 1] == ["-c"] and "pytest" in " ".join(command[i + 1 : i + 2]):
                return [
                    Unknown(text, "`python -c` runs pytest in a way check-tests does not follow")
                ]
            if i < len(command) and command[i].endswith(".py") and cwd is not None:
                return [ScriptCall(command[i], cwd, tuple(env), text)]  # read if it names pytest
            return []
        elif word == "coverage" and command[i + 1 : i + 2] == ["run"]:
            i += 2
            while i < len(command) and command[i].startswith("-") and command[i] != "-m":
                i += 1
            if command[i : i + 2] == ["-m", "pytest"]:
                return [_pytest(command[i + 2 :], cwd, env, state, text)]
            return []
        elif word.rsplit("/", 1)[-1] in ("pytest", "py.test"):
            return [_pytest(command[i + 1 :], cwd, env, state, text)]
        elif word in _SHELLS:
            return _shell(command[i:], cwd, env, state, script_dir, text)
        elif word in ("make", "gmake"):
            return [_make(command[i + 1 :], cwd, env, state, text)]
        elif word in RUNNERS:
            return [Runner(word, text)]
        elif word.endswith((".sh", ".bash")) or ("/" in word and not word.startswith("-")):
            if cwd is None:
                return [
                    Unknown(text, f"it runs in a directory check-tests cannot tell ({state.why})")
                ]
            return [ScriptCall(word, cwd, tuple(env))]
        else:
            return _unknown(command[i:], text)
    return []


def _unknown(command: list[str], text: str) -> list[Found]:
    if command[0] in _NOT_RUNS or _NOT_RUNS_VERBS & set(command[:4]):
        return []
    names = [w.rsplit("/", 1)[-1] for w in command]
    if "pytest" in names or "py.test" in names or any(_PYTEST_IN.search(w) for w in command):
        return [Unknown(text, f"`{command[0]}` runs pytest in a way check-tests does not follow")]
    return []


def _pytest(args, cwd, env, state: _State, text: str) -> Found:
    if cwd is None:
        return Unknown(text, f"it runs in a directory check-tests cannot tell ({state.why})")
    return Invocation(tuple(args), cwd, tuple(env))


def _directory(command: list[str], state: _State, script_dir: str | None) -> None:
    head, rest = command[0], [w for w in command[1:] if w not in ("-L", "-P", "-n", "-q")]
    if head == "cd":
        _chdir(state, rest[0] if rest else None, script_dir)
    elif head == "pushd":
        state.dirs.append(state.cwd)
        _chdir(state, rest[0] if rest else "-", script_dir)
    elif state.dirs:  # popd
        state.old, state.cwd = state.cwd, state.dirs.pop()


def _shell(command, cwd, env, state: _State, script_dir, text: str) -> list[Found]:
    """`bash -c '...'` is the line it runs; `bash x.sh`, `source x.sh` run a script."""
    i = 1
    while i < len(command) and command[i][:1] in ("-", "+") and not _is_c(command[i]):
        i += 1 + (not command[i].startswith("--") and command[i][-1] in "oO")  # -euo pipefail
    if i < len(command) and _is_c(command[i]):  # `-c`, `-lc`, `-ec`
        if len(command) <= i + 1:
            return []
        try:
            found = invocations([command[i + 1]], cwd, tuple(env), script_dir)
        except ValueError:
            return _unknown(command, text)
        if cwd is None:
            why = f"it runs in a directory check-tests cannot tell ({state.why})"
            return [Unknown(text, why) if isinstance(f, Invocation) else f for _, f in found]
        return [f for _, f in found]
    if i >= len(command):
        return []
    if cwd is None:
        return [Unknown(text, f"it runs in a directory check-tests cannot tell ({state.why})")]
    return [ScriptCall(command[i], cwd, tuple(env))]


def _is_c(option: str) -> bool:
    return option.startswith("-") and not option.startswith("--") and "c" in option[1:]


def _make(args: list[str], cwd, env, state: _State, text: str) -> Found:
    if cwd is None:
        return Unknown(text, f"it runs in a directory check-tests cannot tell ({state.why})")
    targets, makefile, i, env = [], "", 0, list(env)
    while i < len(args):
        word = args[i]
        option, has_value = word.split("=", 1)[0], "=" in word
        if word.startswith("--") and option in _MAKE_VALUE:
            value = (
                word.split("=", 1)[1] if has_value else (args[i + 1] if i + 1 < len(args) else "")
            )
            i += 1 if has_value else 2
        elif word[:2] in ("-C", "-f", "-j", "-l", "-o", "-W") and word not in _MAKE_VALUE:
            option, value = word[:2], word[2:]
            i += 1
        elif word in _MAKE_VALUE:
            option, value = word, args[i + 1] if i + 1 < len(args) else ""
            i += 2
        elif word.startswith("-"):
            i += 1
            continue
        elif _ASSIGN.match(word):
            name, _, value = word.partition("=")
            env.append((name, value))
            i += 1
            continue
        else:
            targets.append(word)
            i += 1
            continue
        if "$" in value:
            return Unknown(text, f"`{value}` is a shell expression")
        if option in ("-C", "--directory"):
            cwd = _norm(posixpath.join(cwd, value))
        elif option in ("-f", "--file", "--makefile"):
            makefile = value
    return MakeCall(tuple(targets), makefile, cwd, tuple(env))
