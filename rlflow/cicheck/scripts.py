"""Shell scripts and Makefiles -> shards. Reads a shell script as the shell does (backslash
continuations and quotes across lines joined, here-documents and comments skipped), splits each
line with shell.py, and turns the pytest calls it finds into shards; the scripts and make
targets a line calls are handed back for shards.py to follow. A Makefile's targets are read as
make runs them: prerequisites first, each recipe line its own shell in make's directory,
`$(VAR)` from the Makefile's own assignments. A line whose pytest arguments are a shell
expression, or that runs a task runner whose config mentions pytest (tox, nox, just, ...), is
RF201 unless ci-shards.yaml describes it. The GitHub Actions reader (workflows.py) reads a
step's `run:` lines with the same functions.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from rlflow.cicheck.shard import Shard, bad, cannot_tell, norm, read_bytes, read_text
from rlflow.cicheck.shell import (
    Invocation,
    MakeCall,
    Runner,
    ScriptCall,
    Unknown,
    invocations,
)

# `<<WORD`, `<<-WORD`, `<<'WORD'`, `<<"WORD"`: the lines up to WORD are a here-document
_HEREDOC = re.compile(r"<<(?P<dash>-?)\s*(?P<q>['\"]?)(?P<word>[A-Za-z_][A-Za-z0-9_]*)(?P=q)")
_MAKE_VAR = re.compile(r"\$[({]([A-Za-z_][A-Za-z0-9_]*)[)}]")
_MAKE_ASSIGN = re.compile(
    r"^(?:export\s+|override\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*(?::::?|\?|\+)?=\s*(.*)$"
)
_MAKE_RULE = re.compile(r"^([^\s:=#][^:=#]*?)\s*::?(?!=)\s*([^=;#]*?)\s*(?:;\s*(.*))?$")
# the files a runner (shell.RUNNERS) takes its commands from: pytest in one -> cannot tell
_RUNNER_FILES = {
    "tox": ("tox.ini", "tox.toml", "setup.cfg", "pyproject.toml"),
    "nox": ("noxfile.py",),
    "just": ("justfile", "Justfile", ".justfile"),
    "invoke": ("tasks.py",),
    "inv": ("tasks.py",),
    "task": ("Taskfile.yml", "Taskfile.yaml"),
    "poe": ("pyproject.toml", "poe_tasks.toml"),
    "hatch": ("hatch.toml", "pyproject.toml"),
}


def _checked(file: str, line: int | None, command: str, args) -> tuple[str, ...] | None:
    """The arguments, or None where ci-shards.yaml describes this command instead."""
    for arg in args:
        if "${{" in arg:
            why = "a `${{ }}` expression that is not a matrix value"
            if re.search(r"\$\{\{\s*matrix\.", " ".join(args)):  # a `fromJSON` matrix
                why = "a `${{ }}` expression: a matrix value GitHub computes when the workflow runs"
            return cannot_tell(file, line, command, why, " ".join(args))
        if "$" in arg or "`" in arg:
            why = f"`{arg}` is a shell expression"
            return cannot_tell(file, line, command, why, " ".join(args))
    return tuple(args)


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, command text) as the shell reads a script: backslash continuations
    and quotes that span lines are joined, here-document bodies are skipped (data, not
    commands), and comment lines are dropped."""
    out, logical, start, heredoc = [], "", 1, None
    for number, line in enumerate(text.split("\n"), start=1):
        if heredoc is not None:
            end, strip_tabs = heredoc
            if (line.lstrip("\t") if strip_tabs else line) == end:
                heredoc = None
            continue
        if not logical:
            start = number
        if line.rstrip().endswith("\\") and not _open_quote(logical + line):
            logical += line.rstrip()[:-1] + " "
            continue
        logical += line
        if _open_quote(logical):
            logical += "\n"
            continue
        if not logical.strip().startswith("#"):
            out.append((start, logical))
            opened = _HEREDOC.search(logical)
            if opened:
                heredoc = (opened.group("word"), opened.group("dash") == "-")
        logical = ""
    if logical:
        out.append((start, logical))  # an unbalanced quote: the caller reports it (RF200)
    return out


def _open_quote(text: str) -> bool:
    from rlflow.cicheck.shell import words

    try:
        words(text)
    except ValueError as err:
        return "closing quotation" in str(err)
    return False


def shards_of(
    root: Path,
    rel: str,
    lines: list[tuple[int, str]],
    cwd: str,
    name: str,
    env: tuple = (),
    script_dir: str | None = None,
) -> tuple[list[Shard], list]:
    """The shards in one shell's lines, and the scripts and make targets they call."""
    numbers = [n for n, _ in lines]
    try:
        found = invocations([text for _, text in lines], cwd, env, script_dir)
    except ValueError as err:
        raise bad(rel, numbers[0] if numbers else None, str(err)) from None
    shards, calls = [], []
    for index, item in found:
        number = numbers[index]
        if isinstance(item, Invocation):
            args = _checked(rel, number, lines[index][1], item.args)
            if args is None:
                continue
            shards.append(Shard(f"{rel}:{number}{name}", rel, number, args, item.cwd, item.env))
        elif isinstance(item, (ScriptCall, MakeCall)):
            calls.append(item)
        elif isinstance(item, Unknown):
            cannot_tell(rel, number, lines[index][1].strip(), item.why, item.command)
        elif isinstance(item, Runner) and _runner_runs_pytest(root, item.tool, cwd):
            cannot_tell(
                rel,
                number,
                item.command,
                f"`{item.tool}` runs the commands of its own configuration, which mentions "
                "pytest and which check-tests does not read",
                lines[index][1],
            )
    return shards, calls


def _runner_runs_pytest(root: Path, tool: str, cwd: str) -> bool:
    if tool == "hatch":
        return True  # `hatch test` is pytest, `hatch run` any script
    for name in _RUNNER_FILES.get(tool, ()):
        for where in {cwd, ""}:
            rel = norm(posixpath.join(where, name))
            try:
                text = read_bytes(root / rel, rel).decode("utf-8", "replace")
            except OSError:
                continue
            if name == "pyproject.toml" and f"[tool.{tool}" not in text:
                continue
            if "pytest" in text or "py.test" in text:
                return True
    return False


# -- shell scripts ----------------------------------------------------------------------------
def script_shards(root: Path, rel: str, cwd: str = "", env: tuple = ()) -> tuple[list[Shard], list]:
    try:
        text = read_text(root, rel)
    except OSError:
        return [], []
    lines = logical_lines(text)
    name = f" (from {cwd}/)" if cwd else ""
    return shards_of(root, rel, lines, cwd, name, env, posixpath.dirname(rel))


# -- Makefiles --------------------------------------------------------------------------------
def make_shards(root: Path, call: MakeCall, tracked: set[str]) -> tuple[list[Shard], list]:
    """The recipes `make TARGET` runs (prerequisites first), each line its own shell in make's
    directory; `$(VAR)` from the Makefile's own simple assignments, `$$` as `$`."""
    names = [call.makefile] if call.makefile else ["GNUmakefile", "makefile", "Makefile"]
    rel = next(
        (r for r in (norm(posixpath.join(call.cwd, n)) for n in names) if r in tracked), None
    )
    if rel is None:
        return [], []  # no Makefile in the repository (generated by a configure step)
    text = read_text(root, rel)
    variables = {"MAKE": "make", "CURDIR": "$GITHUB_WORKSPACE/" + call.cwd}
    variables.update({k: v for k, v in call.env})
    rules: dict[str, tuple[list[str], list[tuple[int, str]]]] = {}
    order: list[str] = []
    current: list[str] | None = None
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].lstrip("\t ")
        i += 1
        if line.startswith("\t") and current is not None:
            for target in current:
                rules[target][1].append((number, line[1:]))
            continue
        stripped = line.split("#", 1)[0].rstrip()
        assign = _MAKE_ASSIGN.match(stripped)
        rule = None if assign else _MAKE_RULE.match(stripped)
        if assign:
            variables.setdefault(assign.group(1), assign.group(2).strip())
            current = None
        elif rule:
            current = rule.group(1).split()
            for target in current:
                rules.setdefault(target, ([], []))
                rules[target][0].extend(rule.group(2).split())
                if rule.group(3):
                    rules[target][1].append((number, rule.group(3)))
                if not target.startswith(".") and "%" not in target:
                    order.append(target)
        elif stripped:
            current = None
    goals = list(call.targets) or order[:1]
    shards, calls, done = [], [], set()

    def expand(text: str, depth: int = 0) -> str:
        text = text.replace("$$", "\0")
        for _ in range(10):
            new = _MAKE_VAR.sub(lambda m: variables.get(m.group(1), m.group(0)), text)
            if new == text:
                break
            text = new
        return text.replace("\0", "$")

    def visit(target: str, depth: int) -> None:
        if target in done or depth > 50 or target not in rules:
            return
        done.add(target)
        prerequisites, recipe = rules[target]
        for prerequisite in prerequisites:
            visit(prerequisite, depth + 1)
        for number, line in recipe:
            command = expand(line.lstrip()).lstrip("@-+ \t")
            found, called = shards_of(
                root, rel, [(number, command)], call.cwd, f" (make {target})", call.env
            )
            shards.extend(found)
            calls.extend(called)

    for goal in goals:
        visit(goal, 0)
    return shards, calls
