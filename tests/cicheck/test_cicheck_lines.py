"""check-tests against the CI lines run for real (issue 24): each everyday CI line is written in a
workflow step (or a script, a Makefile), executed by bash exactly as written with a harness
plugin loaded through PYTEST_PLUGINS (whatever pytest it starts only collects, and says what;
a line whose own options run no test, `--co`, records nothing), and the tests check-tests calls
uncollected must be the suite minus what that real run collected.

`uv run` is the one stand-in: a `uv` on PATH that drops `run` and uv's options and runs the rest
(the real one would create and sync an environment, which needs the network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.pins.pins_helpers import make_repo

RLFLOW = Path(sys.executable).parent / "rlflow"
PYPROJECT = '[project]\nname = "demo"\nversion = "0.1.0"\n\n[tool.pytest.ini_options]\n{opts}\n'
TESTS = {
    "tests/unit/test_a.py": "def test_one():\n    pass\n\ndef test_two():\n    pass\n",
    "tests/gpu/test_g.py": "def test_gpu():\n    pass\n",
    "sub/tests/test_s.py": "def test_sub():\n    pass\n",
}
UV_STAND_IN = """#!/bin/sh
# stand-in for `uv run [options] CMD...`: runs CMD (see the module docstring)
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --directory) cd "$2"; shift 2;;
    --extra|--group|--with|--python|-p|--project|--package) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
exec "$@"
"""
STEP = "name: ci\non: [push]\njobs:\n  t:\n    runs-on: ubuntu-latest\n    steps:\n      - {where}run: {line}\n"


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bin")
    (path / "uv").write_text(UV_STAND_IN)
    (path / "uv").chmod(0o755)
    for name in ("pytest", "py.test"):
        (path / name).write_text(f'#!/bin/sh\nexec {sys.executable} -m pytest "$@"\n')
        (path / name).chmod(0o755)
    (path / "harness_plugin.py").write_text(HARNESS)
    return path


def env(bin_dir) -> dict:
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }


HARNESS = """
import os

def pytest_configure(config):
    o = config.option
    config._runs_nothing = o.collectonly or o.setupplan or o.setuponly or o.showfixtures
    o.collectonly = True

def pytest_collection_finish(session):
    if session.config._runs_nothing:
        return
    root = os.environ["HARNESS_ROOT"]
    with open(os.environ["HARNESS_OUT"], "a") as out:
        for item in session.items:
            path = os.path.relpath(str(item.path), root)
            out.write(path + "::" + item.nodeid.split("::", 1)[1] + "\\n")
"""


def real_run(
    root: Path, line: str, cwd: str, bin_dir, out: Path, extra: dict | None = None
) -> set[str]:
    """What `line` collects, run by bash in `cwd` with `extra` in its environment."""
    login = {}
    if "bash -l" in line:
        # A login shell's profile resets PATH (Debian's /etc/profile, pyenv's ~/.bash_profile),
        # and which `pytest` it then finds depends on this machine. As on a CI runner, whose
        # login PATH has its pytest, the profile here puts the stand-ins first.
        home = out.parent / f"{out.name}-home"
        home.mkdir(exist_ok=True)
        (home / ".bash_profile").write_text(f'export PATH="{bin_dir}:$PATH"\n')
        login = {"HOME": str(home)}
    run_env = {
        **env(bin_dir),
        **login,
        **(extra or {}),
        "PYTEST_PLUGINS": "harness_plugin",
        "PYTHONPATH": str(bin_dir),
        "HARNESS_OUT": str(out),
        "HARNESS_ROOT": str(root),
    }
    done = subprocess.run(
        ["bash", "-c", line],
        cwd=root / cwd,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 5), done.stdout + done.stderr
    return set(out.read_text().splitlines()) if out.exists() else set()


LINES = [
    ("pytest -xvs tests/unit", "", 'addopts = "-ra"'),
    ("pytest -vv tests/unit tests/gpu", "", ""),
    ("CUDA_VISIBLE_DEVICES=0 pytest tests/gpu", "", ""),
    ("uv run --extra test pytest tests/unit", "", ""),
    ("timeout 600 pytest tests/unit 2>&1 | tee log.txt", "", ""),
    ("pytest tests", "sub", ""),  # the step's working-directory
    ("cd sub && pytest tests", "", ""),
    ("pytest tests/unit", "", 'addopts = "-q"'),
    ("pytest tests/gpu", "", 'addopts = "-v"'),
]


@pytest.mark.parametrize(("line", "where", "opts"), LINES, ids=[x[0] for x in LINES])
def test_uncollected_is_what_the_real_line_does_not_run(tmp_path, bin_dir, line, where, opts):
    workflow = STEP.format(
        where=f"working-directory: {where}\n        " if where else "", line=json.dumps(line)
    )
    root = make_repo(
        tmp_path / "demo",
        {
            "pyproject.toml": PYPROJECT.format(opts=opts),
            **TESTS,
            ".github/workflows/ci.yml": workflow,
        },
    )
    suite = real_run(root, "pytest", "", bin_dir, tmp_path / "all")
    ran = real_run(root, line, where, bin_dir, tmp_path / "ran")
    assert len(suite) == 4 and ran, (suite, ran)
    done = subprocess.run(
        [str(RLFLOW), "check-tests", "--repo", str(root), "--format", "json"],
        env=env(bin_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    assert set(report["uncollected"]) == suite - ran, report
    assert report["checked"].endswith("4 tests")


def workflow(*steps: str, top: str = "") -> str:
    """A workflow with one job; each step is YAML text ("run: ...")."""
    body = "".join("      - " + step.replace("\n", "\n        ") + "\n" for step in steps)
    return f"name: ci\non: [push]\n{top}jobs:\n  t:\n    runs-on: ubuntu-latest\n    steps:\n{body}"


def block(*lines: str) -> str:
    """`run: |` with these lines."""
    return "run: |\n" + "\n".join("  " + line for line in lines)


# (id, CI files, what the CI really runs: [(line, directory, environment)]), issue 24's
# variants: shell structure, directories, environments, scripts and make targets followed
CI_CASES = [
    ("py.test", {".github/workflows/ci.yml": workflow("run: py.test tests/unit")},
     [("py.test tests/unit", "", {})]),
    ("pushd-popd", {".github/workflows/ci.yml": workflow(
        block("pushd sub", "pytest tests", "popd", "pytest tests/gpu"))},
     [("pytest tests", "sub", {}), ("pytest tests/gpu", "", {})]),
    ("subshell-cd", {".github/workflows/ci.yml": workflow(
        block("(cd sub && pytest tests)", "pytest tests/gpu"))},
     [("(cd sub && pytest tests)\npytest tests/gpu", "", {})]),
    ("cd-minus", {".github/workflows/ci.yml": workflow(
        block("cd sub", "pytest tests", "cd -", "pytest tests/gpu"))},
     [("cd sub\npytest tests\ncd -\npytest tests/gpu", "", {})]),
    ("if-then-brace", {".github/workflows/ci.yml": workflow(
        block("if ! pytest tests/gpu; then exit 1; fi", "{ pytest tests/unit; } 2>&1 | tee l"))},
     [("pytest tests/gpu; pytest tests/unit", "", {})]),
    ("bash-c", {".github/workflows/ci.yml": workflow("run: bash -c 'cd sub && pytest tests'")},
     [("cd sub && pytest tests", "", {})]),
    ("command-v", {".github/workflows/ci.yml": workflow(
        "run: command -v pytest && pytest tests/gpu")},
     [("command -v pytest && pytest tests/gpu", "", {})]),
    ("script-from-working-directory", {
        "sub/run.sh": "#!/bin/sh\npytest tests\n",
        ".github/workflows/ci.yml": workflow("working-directory: sub\nrun: sh ./run.sh",
                                             "run: pytest tests/gpu")},
     [("sh ./run.sh", "sub", {}), ("pytest tests/gpu", "", {})]),
    ("script-env-prefix", {
        ".ci/run": "#!/bin/sh\nPYTEST_ADDOPTS='-k one' sh scripts/t.sh\n",
        "scripts/t.sh": "pytest tests/unit\n"},
     [("sh .ci/run", "", {})]),
    ("script-dirname", {
        "scripts/ci/test.sh": '#!/bin/sh\ncd "$(dirname "$0")/../.."\ncd sub && pytest tests\n',
        ".github/workflows/ci.yml": workflow("run: bash scripts/ci/test.sh")},
     [("bash scripts/ci/test.sh", "", {})]),
    ("workflow-env", {".github/workflows/ci.yml": workflow(
        "run: pytest tests/unit", top="env:\n  PYTEST_ADDOPTS: -k two\n")},
     [("pytest tests/unit", "", {"PYTEST_ADDOPTS": "-k two"})]),
    ("export", {".github/workflows/ci.yml": workflow(
        block("export PYTEST_ADDOPTS='-k one'", "pytest tests/unit"))},
     [("export PYTEST_ADDOPTS='-k one'\npytest tests/unit", "", {})]),
    ("github-workspace", {".github/workflows/ci.yml": workflow(
        "working-directory: ${{ github.workspace }}/sub\nrun: pytest tests")},
     [("pytest tests", "sub", {})]),
    ("make", {
        "Makefile": "PYTEST ?= python -m pytest\n.PHONY: test lint\nlint:\n\truff check .\n"
        "test: gpu\n\t@$(PYTEST) -k 'one' tests/unit\ngpu:\n\tcd tests && $(PYTEST) gpu\n",
        "sub/Makefile": "all:\n\tpytest tests\n",
        ".github/workflows/ci.yml": workflow("run: make lint && make test", "run: make -C sub")},
     [("make test", "", {}), ("pytest tests", "sub", {})]),
    ("workflow-subdirectory", {  # GitHub reads no workflow in a subdirectory
        ".github/workflows/old/ci.yml": workflow("run: pytest"),
        ".github/workflows/ci.yml": workflow("run: pytest tests/unit")},
     [("pytest tests/unit", "", {})]),
    ("composite-action", {
        ".github/actions/gpu/action.yml": "runs:\n  using: composite\n  steps:\n"
        "    - run: pytest gpu\n      shell: bash\n      working-directory: tests\n",
        ".github/workflows/ci.yml": workflow(
            "uses: ./.github/actions/gpu\nenv:\n  PYTEST_ADDOPTS: -k nothing",
            "uses: ./.github/actions/gpu", "run: pytest tests/unit")},
     [("pytest gpu", "tests", {}), ("pytest tests/unit", "", {})]),
    ("matrix-include-only", {  # each `include` of a matrix without lists is its own job
        ".github/workflows/ci.yml": "on: push\njobs:\n  t:\n    strategy:\n      matrix:\n"
        "        include:\n          - p: tests/unit\n          - p: sub\n"
        "    steps:\n      - run: pytest ${{ matrix.p }}\n"},
     [("pytest tests/unit", "", {}), ("pytest sub", "", {})]),
    ("uv-run-project-directory", {".github/workflows/ci.yml": workflow(  # see test_stand_in_uv
        "run: uv run --project sub pytest tests/unit", "run: uv run --directory sub pytest tests")},
     [("uv run --project sub pytest tests/unit; uv run --directory sub pytest tests", "", {})]),
    ("bash-lc", {".github/workflows/ci.yml": workflow(
        "run: bash -lc 'cd sub && pytest tests'", "run: bash -euo pipefail -c 'pytest tests/gpu'")},
     [("bash -lc 'cd sub && pytest tests'; bash -euo pipefail -c 'pytest tests/gpu'", "", {})]),
    ("matrix-missing-key", {  # GitHub: a property that does not exist is ''
        ".github/workflows/ci.yml": "on: push\njobs:\n  t:\n    strategy:\n      matrix:\n"
        "        py: ['3.11', '3.12']\n        include:\n          - py: '3.12'\n"
        "            k: -k one\n    steps:\n      - run: pytest tests/unit ${{ matrix.k }}\n"
        "  u:\n    steps:\n      - run: pytest sub/${{ matrix.none }}\n"},
     [("pytest tests/unit -k one; pytest tests/unit; pytest sub/", "", {})]),
    ("if-false", {".github/workflows/ci.yml": workflow(  # GitHub never runs the first step
        "if: ${{ false }}\nrun: pytest", "if: github.event_name == 'push'\nrun: pytest tests/gpu")},
     [("pytest tests/gpu", "", {})]),
    ("collect-only-runs-nothing", {".github/workflows/ci.yml": workflow(
        "run: pytest --co tests/unit", "run: pytest tests/gpu")},
     [("pytest --co tests/unit; pytest tests/gpu", "", {})]),
]  # fmt: skip


@pytest.mark.parametrize(("files", "runs"), [c[1:] for c in CI_CASES], ids=[c[0] for c in CI_CASES])
def test_uncollected_is_what_the_real_ci_runs(tmp_path, bin_dir, files, runs):
    root = make_repo(
        tmp_path / "demo", {"pyproject.toml": PYPROJECT.format(opts=""), **TESTS, **files}
    )
    suite = real_run(root, "pytest", "", bin_dir, tmp_path / "all")
    ran = set()
    for number, (line, where, extra) in enumerate(runs):
        ran |= real_run(root, line, where, bin_dir, tmp_path / f"ran{number}", extra)
    assert len(suite) == 4 and ran, (suite, ran)
    done = subprocess.run(
        [str(RLFLOW), "check-tests", "--repo", str(root), "--format", "json"],
        env=env(bin_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert set(report["uncollected"]) == suite - ran, report


def test_stand_in_uv_changes_directory_as_the_real_uv_does(tmp_path, bin_dir):
    """The real uv: `--directory` runs the command there, `--project` keeps the cwd."""
    import sysconfig

    real = Path(sysconfig.get_path("scripts")) / "uv"
    project = tmp_path / "p"
    (project / "sub").mkdir(parents=True)
    (project / "sub" / "pyproject.toml").write_text('[project]\nname = "s"\nversion = "0"\n')
    where = "import os; print(os.getcwd())"
    for option in ("--project", "--directory"):
        command = ["run", option, "sub", "python", "-c", where]
        answers = [
            subprocess.run(
                [uv, *command[:1], "--offline", "--no-sync", *command[1:]]
                if uv == str(real)
                else [uv, *command],
                cwd=project,
                env=env(bin_dir) if uv != str(real) else {**os.environ, "UV_NO_CONFIG": "1"},
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            for uv in (str(real), str(bin_dir / "uv"))
        ]
        assert answers[0] == answers[1], (option, answers)


def test_zero_tests_from_a_non_empty_suite_is_an_error(tmp_path, bin_dir):
    root = make_repo(
        tmp_path / "demo",
        {
            "pyproject.toml": PYPROJECT.format(opts='python_files = ["nothing_*.py"]'),
            **TESTS,
            ".ci/run": "pytest tests\n",
        },
    )
    done = subprocess.run(
        [str(RLFLOW), "check-tests", "--repo", str(root)],
        env=env(bin_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "error[RF203]" in done.stderr, done.stdout + done.stderr


CI_FILES = {
    ".github/workflows/ci.yml": STEP.format(where="", line='"pytest tests/unit -k one"')
    + "      - uses: ./.github/actions/t\n        env:\n          PYTEST_ADDOPTS: -x\n",
    ".github/actions/t/action.yml": "runs:\n  using: composite\n  steps:\n"
    "    - run: make -C sub unit\n      shell: bash\n",
    "sub/Makefile": "PYTEST ?= pytest\nunit: gpu\n\t@$(PYTEST) -k 'a or b' tests\ngpu:\n\tpytest\n",
    ".ci/run": "#!/bin/sh\n(cd sub && pytest tests)\npushd sub; sh ./t.sh; popd\n",
    "ci-shards.yaml": "shards:\n  - name: gpu\n    for: tox\n    args: [tests/gpu]\n",
    "pyproject.toml": PYPROJECT.format(opts=""),
}


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    target=st.sampled_from(sorted(CI_FILES)),
    cut=st.floats(min_value=0, max_value=1),
    junk=st.binary(max_size=12),
)
def test_damaged_ci_files_never_give_a_traceback(tmp_path_factory, target, cut, junk):
    """Every file check-tests reads, truncated anywhere and followed by random bytes."""
    from tests.pins.pins_helpers import git

    root = make_repo(tmp_path_factory.mktemp("damaged") / "r", {**TESTS, **CI_FILES})
    data = CI_FILES[target].encode()
    (root / target).write_bytes(data[: int(len(data) * cut)] + junk)
    git(root, "add", "-A")
    done = subprocess.run(
        [str(RLFLOW), "check-tests", "--repo", str(root), "--pytest", "false"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 1, 2), done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
