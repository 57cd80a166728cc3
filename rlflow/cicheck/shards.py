"""CI files -> shards: the pytest argument lists CI really runs, each with where it is written.

Read, in a repository:

    .github/workflows/*.yml|yaml  each step's `run:` lines that call pytest; `${{ matrix.x }}`
                                  is expanded over the job's `strategy.matrix` (lists, include,
                                  exclude), one shard per combination
    shell scripts                 tracked `*.sh`/`*.bash` files and everything under `.ci/` or
                                  `ci/`: lines that call `pytest`, `python -m pytest` or
                                  `uv run [opts] pytest`
    ci-shards.yaml                for other CI systems (documented in docs/lockstep.md):
                                      shards:
                                        - name: unit
                                          args: ["tests/unit", "-m", "not gpu"]
                                        - name: gpu
                                          args: "tests/gpu -k cuda"

A line whose arguments still hold a shell variable (`$TESTS`) cannot be read: exit 2 naming it.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError

SHARDS_FILE = "ci-shards.yaml"
_MATRIX = re.compile(r"\$\{\{\s*matrix\.([A-Za-z0-9_.-]+)\s*\}\}")
_OTHER_EXPR = re.compile(r"\$\{\{.*?\}\}")
# Options that change how tests run or report, not which are collected: dropped.
_RUNTIME_FLAGS = {
    "-x", "--exitfirst", "-q", "--quiet", "-v", "--verbose", "-s", "--lf", "--ff", "--sw",
    "--stepwise", "--no-header", "--showlocals", "-l", "--strict-markers", "--forked",
}  # fmt: skip
_RUNTIME_WITH_VALUE = {
    "-n", "--numprocesses", "--dist", "--maxfail", "--durations", "--junitxml", "--junit-xml",
    "--timeout", "--tb", "-r", "--color", "--cov", "--cov-report", "--reruns", "--basetemp",
    "--log-level", "-W",
}  # fmt: skip


@dataclass(frozen=True)
class Shard:
    name: str  # "file:line (what)" for humans
    file: str
    line: int | None
    args: tuple[str, ...]  # pytest arguments that select tests

    @property
    def selects_everything(self) -> bool:
        return not self.args


def find_shards(root: Path, tracked: list[str]) -> list[Shard]:
    shards: list[Shard] = []
    for rel in tracked:
        if rel.startswith(".github/workflows/") and rel.endswith((".yml", ".yaml")):
            shards += workflow_shards(root, rel)
        elif rel.endswith((".sh", ".bash")) or rel.startswith((".ci/", "ci/")):
            shards += script_shards(root, rel)
    if (root / SHARDS_FILE).is_file():
        shards += yaml_shards(root, SHARDS_FILE)
    return shards


# -- pytest command lines ---------------------------------------------------------------------
def pytest_args(command: str) -> list[str] | None:
    """`uv run --no-sync pytest tests/a -k x && echo` -> ["tests/a", "-k", "x"]; no pytest -> None."""
    command = command.split(" #", 1)[0]
    try:
        words = shlex.split(command, comments=False)
    except ValueError:
        return None
    for i, word in enumerate(words):
        name = word.rsplit("/", 1)[-1]
        is_module = word == "pytest" and i >= 2 and words[i - 1] == "-m"
        if name in ("pytest", "py.test") or is_module:
            if not is_module and i > 0 and words[i - 1] not in _LAUNCHERS and not _uv_run(words, i):
                continue  # e.g. `pip install pytest`
            return _selection(_until_operator(words[i + 1 :]))
    return None


_LAUNCHERS = {"exec", "time", "env", "then", "do", "&&", "||", ";", "run"}


def _uv_run(words: list[str], i: int) -> bool:
    """`uv run [--flags] pytest`: every word between `run` and pytest is an option of uv's."""
    if "run" not in words[:i]:
        return False
    start = words.index("run")
    return all(w.startswith("-") for w in words[start + 1 : i])


def _until_operator(words: list[str]) -> list[str]:
    out = []
    for word in words:
        if word in ("&&", "||", ";", "|", "&") or word.startswith((">", "2>", "1>")):
            break
        out.append(word)
    return out


def _selection(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if arg in _RUNTIME_FLAGS or (flag in _RUNTIME_WITH_VALUE and "=" in arg):
            continue
        if arg in _RUNTIME_WITH_VALUE:
            skip = True
            continue
        if re.fullmatch(r"-r\w+|-n\d+|-W\S+", arg):
            continue
        out.append(arg)
    return out


def _unreadable(file: str, line: int | None, command: str, why: str) -> RlflowError:
    return RlflowError(
        Diagnostic(
            "RF201",
            f"cannot tell which tests `{command.strip()[:120]}` runs: {why}",
            file=file,
            line=line,
            help=f"spell the test paths out, or describe the shard in {SHARDS_FILE} (docs/lockstep.md: "
            "check-tests)",
        )
    )


def _checked(file: str, line: int | None, command: str, args: list[str]) -> list[str]:
    for arg in args:
        if "$" in arg or "`" in arg:
            raise _unreadable(file, line, command, f"`{arg}` is a shell expression")
    return args


# -- shell scripts ----------------------------------------------------------------------------
def script_shards(root: Path, rel: str) -> list[Shard]:
    try:
        text = (root / rel).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []  # not a text script
    shards = []
    logical, start = "", 0
    for number, line in enumerate(text.split("\n"), start=1):
        if not logical:
            start = number
        if line.rstrip().endswith("\\"):
            logical += line.rstrip()[:-1] + " "
            continue
        logical += line
        stripped = logical.strip()
        logical = ""
        if stripped.startswith("#") or "pytest" not in stripped:
            continue
        args = pytest_args(stripped)
        if args is not None:
            args = _checked(rel, start, stripped, args)
            shards.append(Shard(f"{rel}:{start}", rel, start, tuple(args)))
    return shards


# -- GitHub Actions ---------------------------------------------------------------------------
def workflow_shards(root: Path, rel: str) -> list[Shard]:
    import yaml

    text = (root / rel).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise RlflowError(
            Diagnostic(
                "RF200",
                f"malformed workflow: {str(err).splitlines()[0]}",
                file=rel,
                line=mark.line + 1 if mark else None,
                help="GitHub rejects this file too; fix the YAML",
            )
        ) from None
    jobs = data.get("jobs", {}) if isinstance(data, dict) else {}
    lines = text.split("\n")
    shards = []
    for job_name, job in jobs.items() if isinstance(jobs, dict) else []:
        if not isinstance(job, dict):
            continue
        combos = matrix_combinations(
            job.get("strategy", {}).get("matrix") if isinstance(job.get("strategy"), dict) else None
        )
        for step in job.get("steps", []) or []:
            run = step.get("run") if isinstance(step, dict) else None
            if not isinstance(run, str) or "pytest" not in run:
                continue
            for command in _commands(run):
                line = _line_of(lines, command.strip())
                for combo in combos:
                    expanded = _expand(command, combo)
                    args = pytest_args(
                        _OTHER_EXPR.sub("", expanded) if "${{" in expanded else expanded
                    )
                    if args is None:
                        continue
                    if "${{" in expanded:
                        raise _unreadable(
                            rel, line, command, "a `${{ }}` expression that is not a matrix value"
                        )
                    args = _checked(rel, line, expanded, args)
                    label = ", ".join(f"{k}={v}" for k, v in combo.items())
                    name = f"{rel}:{line} ({job_name}{': ' + label if label else ''})"
                    shards.append(Shard(name, rel, line, tuple(args)))
    return shards


def matrix_combinations(matrix) -> list[dict]:
    """GitHub's expansion: the product of the list keys, minus `exclude`, plus `include`."""
    if not isinstance(matrix, dict):
        return [{}]
    keys = [k for k, v in matrix.items() if k not in ("include", "exclude") and isinstance(v, list)]
    combos = [
        dict(zip(keys, values, strict=True))
        for values in itertools.product(*(matrix[k] for k in keys))
    ]
    if not keys:
        combos = []
    for rule in matrix.get("exclude", []) or []:
        if isinstance(rule, dict):
            combos = [c for c in combos if not all(c.get(k) == v for k, v in rule.items())]
    for extra in matrix.get("include", []) or []:
        if not isinstance(extra, dict):
            continue
        matched = False
        for combo in combos:
            if all(combo.get(k) == v for k, v in extra.items() if k in keys):
                combo.update({k: v for k, v in extra.items() if k not in keys})
                matched = True
        if not matched:
            combos.append(dict(extra))
    return combos or [{}]


def _expand(command: str, combo: dict) -> str:
    def value(match: re.Match) -> str:
        node = combo
        for part in match.group(1).split("."):
            if not isinstance(node, dict) or part not in node:
                return match.group(0)
            node = node[part]
        return str(node)

    return _MATRIX.sub(value, command)


def _commands(run: str) -> list[str]:
    out, logical = [], ""
    for line in run.split("\n"):
        if line.rstrip().endswith("\\"):
            logical += line.rstrip()[:-1] + " "
            continue
        logical += line
        if "pytest" in logical and not logical.strip().startswith("#"):
            out.append(logical)
        logical = ""
    return out


def _line_of(lines: list[str], command: str) -> int | None:
    head = command.split("\\")[0].strip()[:60]
    for number, line in enumerate(lines, start=1):
        if head and head in line:
            return number
    return None


# -- ci-shards.yaml ---------------------------------------------------------------------------
def yaml_shards(root: Path, rel: str) -> list[Shard]:
    import yaml

    text = (root / rel).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise _bad_yaml(rel, mark.line + 1 if mark else None, str(err).splitlines()[0]) from None
    entries = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise _bad_yaml(rel, 1, "expected a top-level `shards:` list")
    lines = text.split("\n")
    shards = []
    for i, entry in enumerate(entries):
        name = entry.get("name") if isinstance(entry, dict) else None
        line = _line_of(lines, f"name: {name}") if name else None
        if not isinstance(entry, dict) or not isinstance(name, str):
            raise _bad_yaml(rel, line, f"shard {i + 1} needs a `name` (a string)")
        args = entry.get("args", [])
        if isinstance(args, str):
            args = shlex.split(args)
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise _bad_yaml(
                rel, line, f"shard `{name}`: `args` must be a string or a list of strings"
            )
        shards.append(Shard(f"{rel}:{line} ({name})", rel, line, tuple(_selection(args))))
    return shards


def _bad_yaml(rel: str, line: int | None, reason: str) -> RlflowError:
    return RlflowError(
        Diagnostic(
            "RF200",
            f"malformed `{rel}`: {reason}",
            file=rel,
            line=line,
            help='write `shards: [{name: unit, args: ["tests/unit", "-m", "not gpu"]}]`',
        )
    )
