"""CI files -> shards: the pytest argument lists CI really runs, each with where it is written.

Read, in a repository:

    .github/workflows/*.yml|yaml  each step's `run:` lines that call pytest; `${{ matrix.x }}`
                                  is expanded over the job's `strategy.matrix` (lists, include,
                                  exclude), one shard per combination
    shell scripts                 everything under `.ci/` or `ci/`, and the scripts a workflow
                                  step or such a script calls (`bash x.sh`, `./x.sh`)
    ci-shards.yaml                for other CI systems (documented in the README):
                                      shards:
                                        - name: unit
                                          args: ["tests/unit", "-m", "not gpu"]
                                        - name: gpu
                                          args: "tests/gpu -k cuda"

Lines are split by shell.py (shell words; `cd`, env prefixes, wrappers); the arguments after
pytest are kept exactly as written, for pytest's own parser (collect.py). A line whose arguments
still hold a shell variable (`$TESTS`) cannot be read: exit 2 naming it. A matrix over 256 jobs,
a `steps` or `exclude` that is not a list, a file that is not UTF-8 or a quote left open are
malformed input (RF200, exit 2, file and line).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from rlflow.cicheck.shell import invocations
from rlflow.errors import Diagnostic, RlflowError

SHARDS_FILE = "ci-shards.yaml"
MAX_MATRIX = 256  # GitHub Actions' limit of jobs per matrix
_MATRIX = re.compile(r"\$\{\{\s*matrix\.([A-Za-z0-9_.-]+)\s*\}\}")
_OTHER_EXPR = re.compile(r"\$\{\{.*?\}\}")
# `<<WORD`, `<<-WORD`, `<<'WORD'`, `<<"WORD"`: the lines up to WORD are a here-document
_HEREDOC = re.compile(r"<<(?P<dash>-?)\s*(?P<q>['\"]?)(?P<word>[A-Za-z_][A-Za-z0-9_]*)(?P=q)")
_SCRIPT_CALL = re.compile(
    r"(?:^|[;&|(]\s*|\b(?:bash|sh|source|\.)\s+)(?:bash\s+|sh\s+)?(?:\./)?"
    r"(?P<path>[A-Za-z0-9_./-]+\.(?:sh|bash)|\.ci/[A-Za-z0-9_./-]+|ci/[A-Za-z0-9_./-]+)"
)


@dataclass(frozen=True)
class Shard:
    name: str  # "file:line (what)" for humans
    file: str
    line: int | None
    args: tuple[str, ...]  # pytest's arguments, exactly as CI passes them
    cwd: str = ""  # where CI runs it, relative to the repository root
    env: tuple[tuple[str, str], ...] = ()


def find_shards(root: Path, tracked: list[str]) -> list[Shard]:
    """Workflows, the scripts CI runs (under .ci/ or ci/, or called from a workflow or from such
    a script), and ci-shards.yaml. A tracked script nothing runs is not a shard."""
    shards: list[Shard] = []
    tracked_set = set(tracked)
    scripts = [t for t in tracked if t.startswith((".ci/", "ci/")) and _is_text(root / t)]
    for rel in tracked:
        if rel.startswith(".github/workflows/") and rel.endswith((".yml", ".yaml")):
            found, called = workflow_shards(root, rel)
            shards += found
            scripts += [c for c in called if c in tracked_set]
    seen = set()
    while scripts:
        rel = scripts.pop(0)
        if rel in seen:
            continue
        seen.add(rel)
        found, called = script_shards(root, rel)
        shards += found
        scripts += [c for c in called if c in tracked_set and c not in seen]
    if (root / SHARDS_FILE).is_file():
        shards += yaml_shards(root, SHARDS_FILE)
    return shards


def _is_text(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
        return True
    except (OSError, UnicodeDecodeError):
        return False


def called_scripts(text: str) -> list[str]:
    return [m.group("path").removeprefix("./") for m in _SCRIPT_CALL.finditer(text)]


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


def _bad(file: str, line: int | None, reason: str, help: str | None = None) -> RlflowError:
    return RlflowError(
        Diagnostic("RF200", f"malformed `{file}`: {reason}", file=file, line=line, help=help)
    )


def _checked(file: str, line: int | None, command: str, args) -> tuple[str, ...]:
    for arg in args:
        if "$" in arg or "`" in arg:
            raise _unreadable(file, line, command, f"`{arg}` is a shell expression")
    return tuple(args)


def read_text(root: Path, rel: str) -> str:
    """The file as UTF-8; invalid bytes -> RF200 naming the line."""
    data = (root / rel).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise _bad(
            rel,
            line,
            f"not UTF-8 ({err.reason} at byte {err.start})",
            "save it as UTF-8 (GitHub rejects it too)",
        ) from None


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


def _shards_of(
    rel: str, lines: list[tuple[int, str]], cwd: str, name: str, line_of=None
) -> list[Shard]:
    numbers = [n for n, _ in lines]
    try:
        found = invocations([text for _, text in lines], cwd)
    except ValueError as err:
        raise _bad(rel, numbers[0] if numbers else None, str(err)) from None
    shards = []
    for index, inv in found:
        number = line_of(lines[index][1]) if line_of else numbers[index]
        args = _checked(rel, number, lines[index][1], inv.args)
        shards.append(Shard(f"{rel}:{number}{name}", rel, number, args, inv.cwd, inv.env))
    return shards


# -- shell scripts ----------------------------------------------------------------------------
def script_shards(root: Path, rel: str) -> tuple[list[Shard], list[str]]:
    try:
        text = read_text(root, rel)
    except OSError:
        return [], []
    lines = logical_lines(text)
    return _shards_of(rel, lines, "", ""), called_scripts("\n".join(t for _, t in lines))


# -- GitHub Actions ---------------------------------------------------------------------------
def workflow_shards(root: Path, rel: str) -> tuple[list[Shard], list[str]]:
    import yaml

    text = read_text(root, rel)
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
    line_of = lambda needle: _line_of(lines, needle)  # noqa: E731
    top_dir = _working_directory(data if isinstance(data, dict) else {})
    shards, called = [], []
    for job_name, job in jobs.items() if isinstance(jobs, dict) else []:
        if not isinstance(job, dict):
            continue
        strategy = job.get("strategy")
        matrix = strategy.get("matrix") if isinstance(strategy, dict) else None
        combos = matrix_combinations(matrix, rel, line_of)
        steps = job.get("steps", [])
        if not isinstance(steps, list):
            raise _bad(rel, line_of("steps:"), f"job `{job_name}`: `steps` must be a list of steps")
        job_dir = _working_directory(job) or top_dir
        for step in steps:
            run = step.get("run") if isinstance(step, dict) else None
            if not isinstance(run, str):
                continue
            called += called_scripts("\n".join(t for _, t in logical_lines(run)))
            if "pytest" not in run:
                continue
            cwd = step.get("working-directory") or job_dir or ""
            if not isinstance(cwd, str):
                raise _bad(
                    rel, line_of("working-directory"), "`working-directory` must be a string"
                )
            for combo in combos:
                expanded = _expand(run, combo)
                label = ", ".join(f"{k}={v}" for k, v in combo.items())
                name = f" ({job_name}{': ' + label if label else ''})"
                originals = [t for _, t in logical_lines(run)]
                expanded_lines = [t for _, t in logical_lines(expanded)]
                steps_lines = [
                    (line_of(o.strip().split("${{")[0][:60]), e)
                    for o, e in zip(originals, expanded_lines, strict=False)
                ]
                for shard in _shards_of(rel, steps_lines, _expand(cwd, combo).strip("/"), name):
                    if any("${{" in a for a in shard.args):
                        raise _unreadable(
                            rel,
                            shard.line,
                            " ".join(shard.args),
                            "a `${{ }}` expression that is not a matrix value",
                        )
                    shards.append(shard)
    return shards, called


def _working_directory(table: dict) -> str | None:
    defaults = table.get("defaults")
    run = defaults.get("run") if isinstance(defaults, dict) else None
    value = run.get("working-directory") if isinstance(run, dict) else None
    return value if isinstance(value, str) else None


def matrix_combinations(matrix, rel: str = "", line_of=lambda _: None) -> list[dict]:
    """GitHub's expansion: the product of the list keys, minus `exclude`, plus `include`."""
    if matrix is None or isinstance(matrix, str):
        return [{}]
    if not isinstance(matrix, dict):
        raise _bad(rel, line_of("matrix:"), "`strategy.matrix` must be a mapping")
    for key in ("include", "exclude"):
        rules = matrix.get(key, [])
        if rules is not None and not (
            isinstance(rules, list) and all(isinstance(r, dict) for r in rules)
        ):
            raise _bad(rel, line_of(f"{key}:"), f"matrix `{key}` must be a list of mappings")
    keys = [k for k, v in matrix.items() if k not in ("include", "exclude") and isinstance(v, list)]
    size = 1
    for k in keys:
        size *= max(len(matrix[k]), 1)
    if size > MAX_MATRIX:
        raise _bad(
            rel,
            line_of("matrix:"),
            f"the matrix expands to {size} jobs; GitHub Actions allows at most {MAX_MATRIX}",
            "split the job or drop a dimension",
        )
    combos = (
        [
            dict(zip(keys, values, strict=True))
            for values in itertools.product(*(matrix[k] for k in keys))
        ]
        if keys
        else []
    )
    for rule in matrix.get("exclude") or []:
        combos = [c for c in combos if not all(c.get(k) == v for k, v in rule.items())]
    for extra in matrix.get("include") or []:
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


def _line_of(lines: list[str], command: str) -> int | None:
    head = command.split("\\")[0].strip()[:60]
    for number, line in enumerate(lines, start=1):
        if head and head in line:
            return number
    return None


# -- ci-shards.yaml ---------------------------------------------------------------------------
def yaml_shards(root: Path, rel: str) -> list[Shard]:
    import shlex

    import yaml

    text = read_text(root, rel)
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
            try:
                args = shlex.split(args)
            except ValueError as err:
                raise _bad_yaml(rel, line, f"shard `{name}`: `args` {err}") from None
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise _bad_yaml(
                rel, line, f"shard `{name}`: `args` must be a string or a list of strings"
            )
        cwd = entry.get("working-directory", "")
        if not isinstance(cwd, str):
            raise _bad_yaml(rel, line, f"shard `{name}`: `working-directory` must be a string")
        shards.append(Shard(f"{rel}:{line} ({name})", rel, line, tuple(args), cwd.strip("/")))
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
