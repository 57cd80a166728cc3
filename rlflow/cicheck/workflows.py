"""GitHub Actions workflows -> shards. Reads `.github/workflows/*.yml|yaml` as GitHub runs them:
each job's steps (and the steps of the local composite actions they use, `uses: ./path`),
skipping what `if: false` never runs, with the working directory, shell and `env:` of the
workflow, job and step. A step's `run:` lines are expanded over the job's `strategy.matrix`
(lists, include, exclude; at most 256 jobs, as GitHub), one set of shards per combination, and
then read as shell lines (scripts.py). A step in a shell other than bash/sh that names pytest is
RF201; malformed YAML or a `steps`/`matrix` of the wrong type is RF200, with file and line.
"""

from __future__ import annotations

import itertools
import posixpath
import re
from pathlib import Path

from rlflow.cicheck.scripts import logical_lines, shards_of
from rlflow.cicheck.shard import Shard, bad, cannot_tell, norm, read_text
from rlflow.cicheck.shard import line_of as _line_of  # workflow_shards has a local line_of
from rlflow.cicheck.shell import invocations
from rlflow.errors import Diagnostic, RlflowError

MAX_MATRIX = 256  # GitHub Actions' limit of jobs per matrix
_MATRIX = re.compile(r"\$\{\{\s*matrix\.([A-Za-z0-9_.-]+)\s*\}\}")
_UNKNOWN_MATRIX = "${{ matrix }}"  # a combination key no matrix has: the matrix is an expression
_WORKSPACE = re.compile(r"\$\{\{\s*github\.workspace\s*\}\}")
_OTHER_EXPR = re.compile(r"\$\{\{.*?\}\}")


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
        elif unknown := _computed_keys(matrix):
            combos = [{**combo, _UNKNOWN_MATRIX: unknown} for combo in combos]
        steps = job.get("steps", [])
        if not isinstance(steps, list):
            raise bad(rel, line_of("steps:"), f"job `{job_name}`: `steps` must be a list of steps")
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
            raise bad(rel, line_of("working-directory"), "`working-directory` must be a string")
        shell = step.get("shell") or job_shell or "bash"
        if not isinstance(shell, str) or shell.split()[0] not in ("bash", "sh"):
            if mentions:
                cannot_tell(
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
                    cannot_tell(
                        rel,
                        line_of(f"{key}:"),
                        f"{key}: {value}",
                        "a `${{ }}` expression that is not a matrix value",
                    )
            where = _expand(cwd, combo).replace("$GITHUB_WORKSPACE", "").strip("/")
            if not mentions and not _splits([t for _, t in steps_lines]):
                continue  # a step that names no pytest and is not sh: not read
            found, more = shards_of(root, rel, steps_lines, where, name, env)
            called += more
            shards += found
    return shards, called


def _composite_shards(root: Path, uses: str, combos, job_name, job_env, step, depth):
    import yaml

    where = norm(uses.split("@", 1)[0])
    for name in ("action.yml", "action.yaml"):
        rel = norm(posixpath.join(where, name))
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
        raise bad(rel, line_of("matrix:"), "`strategy.matrix` must be a mapping")
    for key in ("include", "exclude"):
        rules = matrix.get(key, [])
        if _computed(rules):
            continue  # known at run time only: _computed_keys
        if rules is not None and not (
            isinstance(rules, list) and all(isinstance(r, dict) for r in rules)
        ):
            raise bad(rel, line_of(f"{key}:"), f"matrix `{key}` must be a list of mappings")
    keys = [k for k, v in matrix.items() if k not in ("include", "exclude") and isinstance(v, list)]
    size = 1
    for k in keys:
        size *= max(len(matrix[k]), 1)
    if size > MAX_MATRIX:
        raise bad(
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
    for rule in _rules(matrix, "exclude"):
        combos = [c for c in combos if not all(c.get(k) == v for k, v in rule.items())]
    base, added = combos, []
    for extra in _rules(matrix, "include"):
        matched = False
        for combo in base:  # GitHub: an include adds to original combinations, or is its own
            if all(combo.get(k) == v for k, v in extra.items() if k in keys):
                combo.update({k: v for k, v in extra.items() if k not in keys})
                matched = True
        if not matched:
            added.append(dict(extra))
    return base + added or [{}]


def _computed(value) -> bool:
    """A value GitHub computes when the workflow runs (`${{ fromJSON(needs.x.outputs.y) }}`)."""
    return isinstance(value, str) and "${{" in value


def _computed_keys(matrix) -> frozenset[str]:
    """The matrix keys whose values are known only at run time; "*" (every key) when `include`
    or `exclude` is computed: it may add, change or remove any key's value."""
    if not isinstance(matrix, dict):
        return frozenset()
    if _computed(matrix.get("include")) or _computed(matrix.get("exclude")):
        return frozenset("*")
    return frozenset(k for k, v in matrix.items() if _computed(v))


def _rules(matrix: dict, key: str) -> list[dict]:
    rules = matrix.get(key)
    return [] if _computed(rules) else rules or []


def _expand(command: str, combo: dict) -> str:
    command = _WORKSPACE.sub("$GITHUB_WORKSPACE", command)

    def value(match: re.Match) -> str:
        node = combo
        unknown = combo.get(_UNKNOWN_MATRIX)
        if isinstance(unknown, str) or (
            unknown and ("*" in unknown or match.group(1).split(".")[0] in unknown)
        ):
            return match.group(0)  # `${{ fromJSON(...) }}`, the matrix or this key: cannot tell
        for part in match.group(1).split("."):
            if not isinstance(node, dict) or part not in node:
                return ""  # GitHub: a property that does not exist is an empty string
            node = node[part]
        if isinstance(node, bool):
            return str(node).lower()
        return "" if node is None else str(node)

    return _MATRIX.sub(value, command)
