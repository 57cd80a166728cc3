"""`rlflow check-tests` on real repositories with real GitHub Actions workflows, shell scripts and
ci-shards.yaml, collected by the real `pytest --collect-only`; through the console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pins.pins_helpers import GIT_ENV, git, make_repo

RLFLOW = Path(sys.executable).parent / "rlflow"
PYPROJECT = """\
[project]
name = "demo"
version = "0.1.0"

[tool.pytest.ini_options]
testpaths = ["tests"]
markers = ["slow: long tests", "gpu: needs a GPU"]
"""
TESTS = {
    "tests/unit/test_math.py": (
        "import pytest\n\n"
        "def test_add():\n    assert 1 + 1 == 2\n\n"
        "@pytest.mark.slow\ndef test_big():\n    assert True\n\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_param(n):\n    assert n\n"
    ),
    "tests/gpu/test_kernels.py": "def test_kernel():\n    assert True\n",
    "tests/e2e/test_flow.py": "def test_flow_fast():\n    assert True\n\n"
    "def test_flow_full():\n    assert True\n",
}
WORKFLOW = """\
name: ci
on: [push]
jobs:
  test:
    runs-on: ubuntu-latest
    strategy:
      matrix:
        shard: [unit, gpu]
        python: ["3.12"]
        exclude:
          - shard: gpu
    steps:
      - uses: actions/checkout@v4
      - run: |
          pip install uv
          uv run --no-sync pytest tests/${{ matrix.shard }} -m "not slow" -x -v
"""
STEPS = "name: ci\non: [push]\njobs:\n  t:\n    steps:\n      - run: {run}\n"
SCRIPT = '#!/usr/bin/env bash\nset -e\ncd "$(dirname "$0")/.."\npytest tests/e2e \\\n  -k fast\n'


def repo(tmp_path: Path, files: dict[str, str]) -> Path:
    root = make_repo(tmp_path / "demo", {"pyproject.toml": PYPROJECT, **TESTS})
    for name, text in files.items():  # bytes as given (one test needs invalid UTF-8)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(
            text.encode("utf-8", "surrogateescape").replace(b"\xc3\xbf", b"\xff")
        )
    git(root, "add", "-A")
    git(root, "commit", "-qm", "ci files", "--allow-empty")
    return root


def check_tests(root: Path, *args: str) -> subprocess.CompletedProcess:
    # The demo suites need no pytest plugins; loading this venv's (hypothesis, ...) would cost
    # seconds per collection.
    return subprocess.run(
        [str(RLFLOW), "check-tests", "--repo", str(root), *args],
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_lists_every_test_no_shard_collects(tmp_path):
    root = repo(tmp_path, {".github/workflows/ci.yml": WORKFLOW, ".ci/run": SCRIPT})
    done = check_tests(root, "--format", "json")
    assert done.returncode == 1, done.stderr
    import json

    report = json.loads(done.stdout)
    assert report["uncollected"] == [
        "tests/e2e/test_flow.py::test_flow_full",  # -k fast in .ci/run
        "tests/gpu/test_kernels.py::test_kernel",  # the gpu shard is excluded from the matrix
        "tests/unit/test_math.py::test_big",  # -m "not slow"
    ]
    names = [s["name"] for s in report["shards"]]
    assert sorted(names) == [
        ".ci/run:4",
        ".github/workflows/ci.yml:16 (test: shard=unit, python=3.12)",
    ]
    text = check_tests(root).stdout
    assert "error[RF210]: 1 test in tests/gpu/test_kernels.py is collected by no CI shard" in text
    assert "--> tests/gpu/test_kernels.py" in text and "= note: test_kernel" in text


def test_matrix_include_and_ci_shards_yaml_cover_the_rest(tmp_path):
    workflow = WORKFLOW.replace(
        "        exclude:\n          - shard: gpu\n",
        "        include:\n          - shard: gpu\n            python: '3.11'\n",
    )
    shards = (
        "shards:\n  - name: nightly-slow\n    args: [tests/unit, -m, slow]\n"
        '  - name: e2e\n    args: "tests/e2e -k full"\n'
    )
    root = repo(
        tmp_path,
        {".github/workflows/ci.yml": workflow, ".ci/run": SCRIPT, "ci-shards.yaml": shards},
    )
    done = check_tests(root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: 6 shards, 7 tests, every test is collected" in done.stdout


def test_a_bare_pytest_shard_covers_everything_and_a_script_nothing_runs_covers_nothing(tmp_path):
    root = repo(tmp_path, {".ci/run": "#!/bin/sh\nuv run pytest\n"})
    done = check_tests(root)
    assert done.returncode == 0, done.stderr
    assert "ok: 1 shard, 7 tests, every test is collected" in done.stdout
    # A tracked script with a bare pytest that no CI file runs is no shard (issue 24).
    root = repo(tmp_path / "2", {"scripts/dev.sh": "#!/bin/sh\npytest\n", ".ci/run": SCRIPT})
    done = check_tests(root, "--format", "json")
    assert done.returncode == 1 and ".ci/run:4" in done.stdout and "dev.sh" not in done.stdout


def test_scripts_are_read_as_the_shell_reads_them(tmp_path):
    """A quote that spans lines and a here-document are one command, not malformed lines; a
    script named only in a comment is not run (this repository's own .ci/run names
    tests/slurm/start.sh in a comment, and start.sh has a multi-line quoted SQL string)."""
    ci = (
        "#!/usr/bin/env bash\n"
        "# The tests start their own cluster (tests/helper.sh, as root).\n"
        "bash scripts/run.sh\n"
    )
    run = (
        "#!/usr/bin/env bash\n"
        "mysql -e \"\n  CREATE USER 'x';\n  GRANT ALL;\"\n"
        "cat <<'EOF' > notes.txt\n"
        "don't run pytest tests/gpu here: it is text\n"
        "EOF\n"
        "pytest tests/unit\n"
    )
    helper = '#!/bin/sh\necho "unclosed\npytest tests/e2e\n'  # would be RF200 if it were read
    root = repo(tmp_path, {".ci/run": ci, "scripts/run.sh": run, "tests/helper.sh": helper})
    done = check_tests(root, "--format", "json")
    assert done.returncode == 1, done.stdout + done.stderr
    import json

    report = json.loads(done.stdout)
    assert [s["name"] for s in report["shards"]] == ["scripts/run.sh:8"]
    assert report["uncollected"] == [
        "tests/e2e/test_flow.py::test_flow_fast",
        "tests/e2e/test_flow.py::test_flow_full",
        "tests/gpu/test_kernels.py::test_kernel",
    ]


@pytest.mark.parametrize(
    ("files", "where", "message"),
    [
        ({".ci/run": "#!/bin/sh\npytest $TESTS\n"}, ".ci/run:2", "`$TESTS` is a shell expression"),
        (
            {".github/workflows/ci.yml": "jobs: [\n"},
            ".github/workflows/ci.yml:",
            "error[RF200]: malformed workflow",
        ),
        ({"ci-shards.yaml": "shards:\n  - args: [x]\n"}, "ci-shards.yaml", "needs a `name`"),
        ({"tests/unit/test_broken.py": "import nope\n", ".ci/run": SCRIPT}, None, "RF202"),
        ({}, None, "error[RF201]: no CI shard runs pytest"),
        (  # issue 24: clear errors, never a traceback or a run that never ends
            {".github/workflows/ci.yml": "jobs:\n  t:\n    steps: 5\n"},
            ".github/workflows/ci.yml:3",
            "`steps` must be a list",
        ),
        (
            {
                ".github/workflows/ci.yml": "jobs:\n  t:\n    strategy:\n      matrix:\n"
                "        a: [1]\n        exclude: 5\n    steps:\n      - run: pytest\n"
            },
            ".github/workflows/ci.yml:6",
            "matrix `exclude` must be a list of mappings",
        ),
        (
            {
                ".github/workflows/ci.yml": "jobs:\n  t:\n    strategy:\n      matrix:\n"
                + "".join(f"        k{i}: [1, 2, 3, 4, 5, 6, 7]\n" for i in range(6))
                + "    steps:\n      - run: pytest tests/${{ matrix.k0 }}\n"
            },
            ".github/workflows/ci.yml:4",
            "the matrix expands to 117649 jobs; GitHub Actions allows at most 256",
        ),
        (
            {".github/workflows/ci.yml": "jobs:\n  t:\n    steps:\n      - run: pytest \xff\n"},
            ".github/workflows/ci.yml:4",
            "not UTF-8",
        ),
        (
            {"ci-shards.yaml": 'shards:\n  - name: unit\n    args: "tests \'unit"\n'},
            "ci-shards.yaml:2",
            "No closing quotation",
        ),
        # issue 24: a command check-tests cannot follow says so (it was read as running nothing)
        *(
            (
                {".github/workflows/ci.yml": STEPS.format(run=run), **extra},
                ".github/workflows/ci.yml:6",
                f"error[RF201]: cannot tell which tests `{shown}` runs: {why}",
            )
            for run, extra, shown, why in [
                ("tox -e py", {"tox.ini": "[testenv]\ncommands = pytest\n"}, "tox -e py", "`tox`"),
                ("nox -s t", {"noxfile.py": "s.run('pytest')\n"}, "nox -s t", "`nox` runs"),
                ("docker run img pytest", {}, "docker run img pytest", "`docker` runs pytest"),
                (
                    "python -c 'import pytest; pytest.main()'",
                    {},
                    "python -c 'import pytest; pytest.main()'",
                    "`python -c` runs pytest",
                ),
                (
                    "cd ~ && pytest",
                    {},
                    "cd ~ && pytest",
                    "it runs in a directory check-tests cannot tell (`cd ~`",
                ),
                ("pytest tests/${{ env.T }}", {}, "pytest tests/${{ env.T }}", "a `${{"),
            ]
        ),
        *(  # a Python script CI runs that names pytest
            (
                {".github/workflows/ci.yml": STEPS.format(run=run), "ci/t.py": script},
                "ci/t.py",
                f"cannot tell which tests `{run}` runs: `ci/t.py` is not a shell script",
            )
            for run, script in [
                ("python ci/t.py", "import pytest\npytest.main(['tests/unit'])\n"),
                (
                    "./ci/t.py",
                    "#!/usr/bin/env python3\nimport subprocess\nsubprocess.run(['pytest'])\n",
                ),
            ]
        ),
        (
            {".github/workflows/ci.yml": STEPS.format(run="pytest") + "        shell: python\n"},
            ".github/workflows/ci.yml:6",
            "it runs in `shell: python`, which check-tests does not read",
        ),
        (  # a matrix that is an expression: its values are unknown
            {
                ".github/workflows/ci.yml": "jobs:\n  t:\n    strategy:\n      matrix: "
                "${{ fromJSON(needs.a.outputs.m) }}\n    steps:\n      - run: pytest ${{ matrix.p }}\n"
            },
            ".github/workflows/ci.yml:6",
            "cannot tell which tests `pytest ${{ matrix.p }}` runs: a `${{ }}` expression",
        ),
        *(  # one key, or include/exclude, computed when the workflow runs (issue 36): these got
            # "every test is collected" (the value read as empty: a bare `pytest tests/`)
            (
                {
                    ".github/workflows/ci.yml": "jobs:\n  t:\n    strategy:\n      matrix:\n"
                    f"        {key}: ${{{{ fromJSON(needs.plan.outputs.m) }}}}\n"
                    "        os: [ubuntu-latest]\n    steps:\n"
                    "      - run: pytest tests/${{ matrix.shard }}\n"
                },
                ".github/workflows/ci.yml:8",
                "cannot tell which tests `pytest tests/${{ matrix.shard }}` runs: a `${{ }}` "
                "expression: a matrix value GitHub computes when the workflow runs",
            )
            for key in ("shard", "include", "exclude")
        ),
    ],
)
def test_unreadable_input_is_exit_2(tmp_path, files, where, message):
    root = repo(tmp_path, files)
    done = check_tests(root)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    if where:
        assert f"--> {where}" in done.stderr


def test_the_shipped_hook_blocks_a_commit_adding_an_uncovered_test(tmp_path):
    """The second hook of .pre-commit-hooks.yaml, as a local hook with the same entry, through
    the real `pre-commit install` and `git commit`."""
    import yaml

    from tests.pins.pins_helpers import REPO_ROOT

    hooks = yaml.safe_load((REPO_ROOT / ".pre-commit-hooks.yaml").read_text())
    hook = next(h for h in hooks if h["id"] == "rlflow-check-tests")
    assert hook["entry"] == "rlflow check-tests" and hook["pass_filenames"] is False
    config = (
        "repos:\n  - repo: local\n    hooks:\n      - id: rlflow-check-tests\n"
        f"        name: {hook['name']}\n        entry: {RLFLOW} check-tests\n"
        f"        language: system\n        pass_filenames: false\n"
        f"        files: '{hook['files']}'\n"
    )
    root = repo(tmp_path, {".ci/run": "#!/bin/sh\npytest tests/unit tests/e2e\n"})
    (root / ".pre-commit-config.yaml").write_text(config)
    git(root, "add", ".pre-commit-config.yaml")
    git(root, "commit", "-qm", "hooks", "--no-verify")
    env = {
        **os.environ,
        **GIT_ENV,
        "PRE_COMMIT_HOME": str(tmp_path / "pc"),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    subprocess.run([sys.executable, "-m", "pre_commit", "install"], cwd=root, env=env, check=True)
    git(root, "rm", "-q", "-r", "tests/gpu")
    done = subprocess.run(
        ["git", "commit", "-m", "no gpu"], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (root / "tests" / "new").mkdir()
    (root / "tests" / "new" / "test_new.py").write_text("def test_new():\n    assert True\n")
    git(root, "add", "tests/new/test_new.py")
    done = subprocess.run(
        ["git", "commit", "-m", "new"], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert (
        "error[RF210]: 1 test in tests/new/test_new.py is collected by no CI shard"
        in done.stdout + done.stderr
    )


def test_ci_shards_yaml_describes_what_a_command_runs(tmp_path):
    """`for:` says which CI command a ci-shards.yaml shard stands for: the RF201 "cannot tell"
    for it goes, and its args count instead."""
    workflow = STEPS.format(run="tox -e py") + "      - run: pytest tests/unit tests/e2e\n"
    shards = 'shards:\n  - name: tox\n    for: "tox  -e py"\n    args: [tests/gpu]\n'
    files = {".github/workflows/ci.yml": workflow, "tox.ini": "[testenv]\ncommands = pytest\n"}
    done = check_tests(repo(tmp_path, files))
    assert done.returncode == 2 and "cannot tell which tests `tox -e py`" in done.stderr
    assert 'a shard with `for: "tox -e py"`' in done.stderr
    done = check_tests(repo(tmp_path / "2", {**files, "ci-shards.yaml": shards}))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: 2 shards, 7 tests, every test is collected" in done.stdout


def test_other_files_under_ci_are_not_shell_and_other_ci_systems_are_named(tmp_path):
    """A YAML or Python file under ci/ is not read as sh (an apostrophe in it was RF200), and a
    CI system check-tests does not read, naming pytest, is a warning, not silence."""
    files = {
        "ci/config.yml": "description: it's the nightly\n",
        ".ci/check.py": "import subprocess\nsubprocess.run(['pytest', \"it's\"])\n",
        ".ci/run": "#!/bin/sh\npytest tests\n",
        ".gitlab-ci.yml": "test:\n  script:\n    - pytest tests/gpu\n",
    }
    done = check_tests(repo(tmp_path, files))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warning[RF205]: `.gitlab-ci.yml` names pytest, and check-tests does not read it" in (
        done.stdout
    )
    assert "ok: 1 shard, 7 tests, every test is collected" in done.stdout


def test_test_files_a_plain_pytest_does_not_collect_are_named(tmp_path):
    """testpaths narrower than the tests: a bare `pytest` in CI never runs tests/gpu or
    tests/e2e, and check-tests, whose suite is a plain `pytest`, says they are not checked
    (it said "ok" and nothing else). A module skipped at import is collected, not named."""
    pyproject = PYPROJECT.replace('testpaths = ["tests"]', 'testpaths = ["tests/unit"]')
    skipped = "import pytest\n\npytest.importorskip('no_such_module')\n"
    files = {"pyproject.toml": pyproject, ".ci/run": "pytest\n", "tests/unit/test_s.py": skipped}
    done = check_tests(repo(tmp_path, files))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "warning[RF206]: 2 tracked test files that a plain `pytest` does not collect" in done.stdout
    )
    assert "= note: tests/e2e/test_flow.py, tests/gpu/test_kernels.py\n" in done.stdout


def test_tests_the_configuration_deselects_are_named_unless_a_shard_selects_them(tmp_path):
    """addopts `-m "not slow"`: a plain `pytest` leaves test_big out, so it is not in the suite;
    no CI line selects it either, and check-tests says so (it said a bare "ok")."""
    pyproject = PYPROJECT + "addopts = \"-m 'not slow'\"\n"
    files = {"pyproject.toml": pyproject, ".ci/run": "pytest\n"}
    done = check_tests(repo(tmp_path, files))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warning[RF207]: 1 test that the pytest configuration itself deselects" in done.stdout
    assert "= note: tests/unit/test_math.py::test_big\n" in done.stdout
    files[".ci/run"] = "pytest\npytest -m slow tests/unit\n"
    done = check_tests(repo(tmp_path / "2", files))
    assert done.returncode == 0 and "RF207" not in done.stdout, done.stdout + done.stderr


def test_lines_that_only_name_pytest_are_no_finding(tmp_path):
    """Installing, syncing or cloning something called pytest runs no test: no RF201."""
    steps = (
        "uv sync --extra pytest",
        "pip install pytest pytest-cov",
        "git clone https://github.com/pytest-dev/pytest",
        "tool --plugin pytest-cov",
        "command -v pytest",
        "pytest",
    )
    workflow = "jobs:\n  t:\n    steps:\n" + "".join(f"      - run: {s}\n" for s in steps)
    done = check_tests(repo(tmp_path, {".github/workflows/ci.yml": workflow}))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: 1 shard, 7 tests, every test is collected" in done.stdout
