"""CI files -> shards: the pytest argument lists CI really runs, each with where it is written.

Read, in a repository:

    .github/workflows/*.yml|yaml  each step's `run:` lines that call pytest; `${{ matrix.x }}`
                                  is expanded over the job's `strategy.matrix` (lists, include,
                                  exclude), one shard per combination
    shell scripts                 everything under `.ci/` or `ci/`, and the scripts a workflow
                                  step or such a script calls (`bash x.sh`, `./x.sh`), from the
                                  call's directory, with its environment
    Makefiles                     the recipes of the targets a line runs (`make test`)
    ci-shards.yaml                for other CI systems (documented in the README), and `for:`
                                  what a command check-tests cannot follow runs:
                                      shards:
                                        - name: unit
                                          args: ["tests/unit", "-m", "not gpu"]
                                        - name: tox
                                          for: "tox -e py"
                                          args: "tests/gpu -k cuda"

Lines are split by shell.py (shell words; `cd`, env prefixes, wrappers); the arguments after
pytest are kept exactly as written, for pytest's own parser (collect.py). A line whose arguments
still hold a shell variable (`$TESTS`), or that runs pytest in a way shell.py does not follow
(`docker run img pytest`, `tox` whose config mentions pytest), cannot be read: RF201, exit 2
naming it, unless ci-shards.yaml describes it (`for:`). A matrix over 256 jobs,
a `steps` or `exclude` that is not a list, a file that is not UTF-8 or a quote left open are
malformed input (RF200, exit 2, file and line).
"""

from __future__ import annotations

import itertools
import json
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from rlflow.cicheck.shell import (
    Invocation,
    MakeCall,
    Runner,
    ScriptCall,
    Unknown,
    invocations,
)
from rlflow.errors import Diagnostic, RlflowError

SHARDS_FILE = "ci-shards.yaml"
MAX_MATRIX = 256  # GitHub Actions' limit of jobs per matrix
_MATRIX = re.compile(r"\$\{\{\s*matrix\.([A-Za-z0-9_.-]+)\s*\}\}")
_UNKNOWN_MATRIX = "${{ matrix }}"  # a combination key no matrix has: the matrix is an expression
_WORKSPACE = re.compile(r"\$\{\{\s*github\.workspace\s*\}\}")
_OTHER_EXPR = re.compile(r"\$\{\{.*?\}\}")
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


@dataclass(frozen=True)
class Shard:
    name: str  # "file:line (what)" for humans
    file: str
    line: int | None
    args: tuple[str, ...]  # pytest's arguments, exactly as CI passes them
    cwd: str = ""  # where CI runs it, relative to the repository root
    env: tuple[tuple[str, str], ...] = ()
    describes: tuple[str, ...] = ()  # ci-shards.yaml `for:`: the CI commands it stands for


def find_shards(root: Path, tracked: list[str]) -> list[Shard]:
    """Workflows, the scripts CI runs (under .ci/ or ci/, or called from a workflow or from such
    a script, from the directory and with the environment of the call), the make targets they
    run, and ci-shards.yaml. A tracked script nothing runs is not a shard."""
    described = yaml_shards(root, SHARDS_FILE) if (root / SHARDS_FILE).is_file() else []
    _DESCRIBED.clear()
    _DESCRIBED.update(_spoken(c) for shard in described for c in shard.describes)
    try:
        return _find_shards(root, tracked) + described
    finally:
        _DESCRIBED.clear()


def _find_shards(root: Path, tracked: list[str]) -> list[Shard]:
    shards: list[Shard] = []
    tracked_set = set(tracked)
    calls: list = [ScriptCall(t, "", ()) for t in tracked if t.startswith((".ci/", "ci/"))]
    calls = [c for c in calls if _is_shell(root / c.path)]
    for rel in tracked:
        name = rel.removeprefix(".github/workflows/")
        if name != rel and "/" not in name and rel.endswith((".yml", ".yaml")):  # as GitHub
            found, called = workflow_shards(root, rel)
            shards += found
            calls += called
    seen = set()
    while calls:
        call = calls.pop(0)
        if call in seen or len(seen) > 10_000:
            continue
        seen.add(call)
        if isinstance(call, MakeCall):
            found, called = make_shards(root, call, tracked_set)
        else:
            rel = _norm(posixpath.join(call.cwd, call.path))
            if rel not in tracked_set:
                continue  # not a file of the repository (a tool on PATH, a generated file)
            if call.command or not _is_shell(root / rel, called=True):
                _not_sh(root, rel, call)
                continue
            found, called = script_shards(root, rel, call.cwd, call.env)
        shards += found
        calls += [c for c in called if c not in seen]
    return shards


# other CI systems' files: check-tests does not read them (RF205 where one names pytest)
OTHER_CI = (
    ".gitlab-ci.yml", ".circleci/config.yml", "Jenkinsfile", "azure-pipelines.yml",
    ".travis.yml", "bitbucket-pipelines.yml", ".drone.yml", "appveyor.yml", ".woodpecker.yml",
    "buildkite.yml", ".buildkite/pipeline.yml", "cloudbuild.yaml", ".cirrus.yml",
)  # fmt: skip


def unread_ci(root: Path, tracked: list[str]) -> list[str]:
    found = []
    for rel in sorted(set(tracked)):
        if rel in OTHER_CI or rel.startswith((".gitlab/ci/", ".buildkite/", ".circleci/")):
            try:
                text = (root / rel).read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            if "pytest" in text or "py.test" in text:
                found.append(rel)
    return found


def _norm(path: str) -> str:
    resolved = posixpath.normpath(path) if path else "."
    return "" if resolved == "." else resolved


def _is_shell(path: Path, called: bool = False) -> bool:
    """A file under .ci/ or ci/ (or one a line runs: `called`) that is a shell script: `.sh`/
    `.bash`, or no extension and no other interpreter's `#!` (config files, Python, Dockerfiles
    there are not read as sh)."""
    if not _is_text(path):
        return False
    if path.suffix in (".sh", ".bash"):
        return True
    if path.suffix and called and path.suffix != ".py":
        return True  # `./run.ci`: the shell runs it by its `#!`, read as sh below
    if path.suffix or path.name.startswith(".") or path.name in ("Dockerfile", "Makefile"):
        return False
    with path.open("rb") as stream:
        first = stream.readline(200)
    return not first.startswith(b"#!") or any(
        shell in first for shell in (b"sh\n", b"bash", b"/sh ", b"env sh", b"zsh", b"dash")
    )


def _not_sh(root: Path, rel: str, call: ScriptCall) -> None:
    """A script CI runs that is not sh (Python): check-tests cannot tell what it runs, which
    matters only where it names pytest."""
    try:
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    if "pytest" in text or "py.test" in text:
        _cannot_tell(
            rel,
            None,
            call.command or call.path,
            f"`{rel}` is not a shell script, and it names pytest",
        )


def _is_text(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
        return True
    except (OSError, UnicodeDecodeError):
        return False


# CI commands ci-shards.yaml describes (`for:`), as shell words joined by spaces; set by
# find_shards while it reads
_DESCRIBED: set[str] = set()


def _spoken(command: str) -> str:
    from rlflow.cicheck.shell import words

    try:
        return " ".join(words(command))
    except ValueError:
        return " ".join(command.split())


def _cannot_tell(file: str, line: int | None, command: str, why: str, *also: str) -> None:
    """RF201 for a command whose tests check-tests cannot tell, unless a shard of ci-shards.yaml
    says it describes that command (`for:`)."""
    if any(_spoken(c) in _DESCRIBED for c in (command, *also)):
        return
    raise RlflowError(
        Diagnostic(
            "RF201",
            f"cannot tell which tests `{command.strip()[:120]}` runs: {why}",
            file=file,
            line=line,
            help=f"spell the test paths out, or describe what it runs in {SHARDS_FILE} "
            f"(a shard with `for: {json.dumps(command.strip()[:120])}`; docs/lockstep.md: "
            "check-tests)",
        )
    )


def _bad(file: str, line: int | None, reason: str, help: str | None = None) -> RlflowError:
    return RlflowError(
        Diagnostic("RF200", f"malformed `{file}`: {reason}", file=file, line=line, help=help)
    )


def _checked(file: str, line: int | None, command: str, args) -> tuple[str, ...] | None:
    """The arguments, or None where ci-shards.yaml describes this command instead."""
    for arg in args:
        if "${{" in arg:
            why = "a `${{ }}` expression that is not a matrix value"
            return _cannot_tell(file, line, command, why, " ".join(args))
        if "$" in arg or "`" in arg:
            why = f"`{arg}` is a shell expression"
            return _cannot_tell(file, line, command, why, " ".join(args))
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
        raise _bad(rel, numbers[0] if numbers else None, str(err)) from None
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
            _cannot_tell(rel, number, lines[index][1].strip(), item.why, item.command)
        elif isinstance(item, Runner) and _runner_runs_pytest(root, item.tool, cwd):
            _cannot_tell(
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
            path = root / where / name
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
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
    return _shards_of(root, rel, lines, cwd, name, env, posixpath.dirname(rel))


# -- Makefiles --------------------------------------------------------------------------------
def make_shards(root: Path, call: MakeCall, tracked: set[str]) -> tuple[list[Shard], list]:
    """The recipes `make TARGET` runs (prerequisites first), each line its own shell in make's
    directory; `$(VAR)` from the Makefile's own simple assignments, `$$` as `$`."""
    names = [call.makefile] if call.makefile else ["GNUmakefile", "makefile", "Makefile"]
    rel = next(
        (r for r in (_norm(posixpath.join(call.cwd, n)) for n in names) if r in tracked), None
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
            found, called = _shards_of(
                root, rel, [(number, command)], call.cwd, f" (make {target})", call.env
            )
            shards.extend(found)
            calls.extend(called)

    for goal in goals:
        visit(goal, 0)
    return shards, calls


# -- GitHub Actions ---------------------------------------------------------------------------
def workflow_shards(root: Path, rel: str) -> tuple[list[Shard], list]:
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
    top = data if isinstance(data, dict) else {}
    top_dir, top_env, top_shell = _working_directory(top), _env_of(top), _shell_of(top)
    shards, called = [], []
    for job_name, job in jobs.items() if isinstance(jobs, dict) else []:
        if not isinstance(job, dict) or _never(job):
            continue
        strategy = job.get("strategy")
        matrix = strategy.get("matrix") if isinstance(strategy, dict) else None
        combos = matrix_combinations(matrix, rel, line_of)
        if isinstance(matrix, str):
            combos = [{_UNKNOWN_MATRIX: matrix}]
        steps = job.get("steps", [])
        if not isinstance(steps, list):
            raise _bad(rel, line_of("steps:"), f"job `{job_name}`: `steps` must be a list of steps")
        job_dir = _working_directory(job) or top_dir
        job_env = {**top_env, **_env_of(job)}
        job_shell = _shell_of(job) or top_shell
        found, more = _steps_shards(
            root, rel, line_of, steps, combos, job_name, job_dir or "", job_env, job_shell
        )
        shards += found
        called += more
    return shards, called


def _steps_shards(
    root: Path, rel, line_of, steps, combos, job_name, job_dir, job_env, job_shell, depth=0
) -> tuple[list[Shard], list]:
    """The shards of a job's steps, and of the local composite actions they use
    (`uses: ./path`, whose steps run from the workspace with the step's env)."""
    shards, called = [], []
    for step in steps:
        if isinstance(step, dict) and _never(step):
            continue
        uses = step.get("uses") if isinstance(step, dict) else None
        if isinstance(uses, str) and uses.startswith("./") and depth < 10:
            found, more = _composite_shards(root, uses, combos, job_name, job_env, step, depth)
            shards += found
            called += more
        run = step.get("run") if isinstance(step, dict) else None
        if not isinstance(run, str):
            continue
        mentions = "pytest" in run or "py.test" in run
        cwd = step.get("working-directory") or job_dir or ""
        if not isinstance(cwd, str):
            raise _bad(rel, line_of("working-directory"), "`working-directory` must be a string")
        shell = step.get("shell") or job_shell or "bash"
        if not isinstance(shell, str) or shell.split()[0] not in ("bash", "sh"):
            if mentions:
                _cannot_tell(
                    rel,
                    line_of(run.strip().split("\n")[0][:60]),
                    run.split("\n")[0],
                    f"it runs in `shell: {shell}`, which check-tests does not read",
                )
            continue
        step_env = {**job_env, **_env_of(step)}
        for combo in combos:
            expanded = _expand(run, combo)
            label = ", ".join(f"{k}={v}" for k, v in combo.items() if k != _UNKNOWN_MATRIX)
            name = f" ({job_name}{': ' + label if label else ''})"
            originals = [t for _, t in logical_lines(run)]
            expanded_lines = [t for _, t in logical_lines(expanded)]
            steps_lines = [
                (line_of(o.strip().split("${{")[0][:60]), e)
                for o, e in zip(originals, expanded_lines, strict=False)
            ]
            env = tuple((k, _expand(v, combo)) for k, v in step_env.items())
            for key, value in env:
                if key.startswith("PYTEST") and "${{" in value:
                    _cannot_tell(
                        rel,
                        line_of(f"{key}:"),
                        f"{key}: {value}",
                        "a `${{ }}` expression that is not a matrix value",
                    )
            where = _expand(cwd, combo).replace("$GITHUB_WORKSPACE", "").strip("/")
            if not mentions and not _splits([t for _, t in steps_lines]):
                continue  # a step that names no pytest and is not sh: not read
            found, more = _shards_of(root, rel, steps_lines, where, name, env)
            called += more
            shards += found
    return shards, called


def _composite_shards(root: Path, uses: str, combos, job_name, job_env, step, depth):
    import yaml

    where = _norm(uses.split("@", 1)[0])
    for name in ("action.yml", "action.yaml"):
        rel = _norm(posixpath.join(where, name))
        if (root / rel).is_file():
            break
    else:
        return [], []
    text = read_text(root, rel)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return [], []  # GitHub fails the job that uses it
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict) or runs.get("using") != "composite":
        return [], []
    steps = runs.get("steps")
    if not isinstance(steps, list):
        return [], []
    lines = text.split("\n")
    env = {**job_env, **_env_of(step)}
    return _steps_shards(
        root,
        rel,
        lambda needle: _line_of(lines, needle),
        steps,
        combos,
        job_name,
        "",
        env,
        None,
        depth + 1,
    )


def _never(table: dict) -> bool:
    """`if: false` (or `${{ false }}`): GitHub never runs that job or step."""
    value = table.get("if")
    if value is False:
        return True
    return isinstance(value, str) and re.sub(r"^\$\{\{|\}\}$|\s", "", value) in ("false", "0")


def _splits(lines: list[str]) -> bool:
    try:
        invocations(lines)
    except ValueError:
        return False
    return True


def _env_of(table: dict) -> dict[str, str]:
    """A workflow's, job's or step's `env:` (GitHub writes booleans as true/false)."""
    env = table.get("env")
    if not isinstance(env, dict):
        return {}
    return {
        str(k): (str(v).lower() if isinstance(v, bool) else str(v))
        for k, v in env.items()
        if v is not None and not isinstance(v, (dict, list))
    }


def _shell_of(table: dict) -> str | None:
    defaults = table.get("defaults")
    run = defaults.get("run") if isinstance(defaults, dict) else None
    value = run.get("shell") if isinstance(run, dict) else None
    return value if isinstance(value, str) else None


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
    base, added = combos, []
    for extra in matrix.get("include") or []:
        matched = False
        for combo in base:  # GitHub: an include adds to original combinations, or is its own
            if all(combo.get(k) == v for k, v in extra.items() if k in keys):
                combo.update({k: v for k, v in extra.items() if k not in keys})
                matched = True
        if not matched:
            added.append(dict(extra))
    return base + added or [{}]


def _expand(command: str, combo: dict) -> str:
    command = _WORKSPACE.sub("$GITHUB_WORKSPACE", command)

    def value(match: re.Match) -> str:
        node = combo
        if _UNKNOWN_MATRIX in combo:
            return match.group(0)  # `matrix: ${{ fromJSON(...) }}`: cannot tell
        for part in match.group(1).split("."):
            if not isinstance(node, dict) or part not in node:
                return ""  # GitHub: a property that does not exist is an empty string
            node = node[part]
        if isinstance(node, bool):
            return str(node).lower()
        return "" if node is None else str(node)

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
        describes = entry.get("for", [])
        describes = [describes] if isinstance(describes, str) else describes
        if not isinstance(describes, list) or not all(isinstance(d, str) for d in describes):
            raise _bad_yaml(
                rel, line, f"shard `{name}`: `for` must be a CI command (a string) or a list"
            )
        shards.append(
            Shard(
                f"{rel}:{line} ({name})",
                rel,
                line,
                tuple(args),
                cwd.strip("/"),
                describes=tuple(describes),
            )
        )
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
