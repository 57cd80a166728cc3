"""A pytest plugin check-tests loads into every collection it runs (`-p rlflow.cicheck.plugin`):
writes the collected test ids, as `path-from-the-repository-root::rest`, to the file named by
RLFLOW_CHECK_TESTS_OUT. Output flags (`-q`, `-v`, `-s`, addopts) cannot change what is read,
and a shard run from a subdirectory (or with its own rootdir) is named from the repository
root.

check-tests adds `--collect-only` itself; when the shard's own arguments or addopts already
hold an option that makes pytest run no test (`--collect-only`, `--setup-plan`, `--fixtures`,
...), the first line written is `#runs-nothing: <option>`: that CI line runs no test. Lines
`#module: PATH` name the test modules collected (with no test, or skipped, included) and
`#python_files: PATTERNS` the configuration's test-file patterns, `#deselected: ID` the tests
-k, -m or --deselect (the shard's own or addopts) leave out."""

from __future__ import annotations

import os
import shlex

import pytest

_RUNS_NOTHING = (
    ("collectonly", "--collect-only"),
    ("setuponly", "--setup-only"),
    ("setupplan", "--setup-plan"),
    ("showfixtures", "--fixtures"),
    ("show_fixtures_per_test", "--fixtures-per-test"),
)


def _runs_nothing(config) -> list[str]:
    count = os.environ.get("RLFLOW_CHECK_TESTS_NARGS")
    if count is None:
        return []
    args = [str(a) for a in config.invocation_params.args][: int(count)]
    try:
        addopts = list(config.getini("addopts"))
        addopts += shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))
        namespace = config._parser.parse_known_args(addopts + args)
    except Exception:  # noqa: BLE001  pytest itself parsed these; an odd plugin option only
        return []
    return [flag for attr, flag in _RUNS_NOTHING if getattr(namespace, attr, False)]


_MODULES: list[str] = []
_ALL: list = []


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items) -> None:
    """The items before -k, -m or --deselect (from addopts too) leave any out."""
    _ALL[:] = list(items)


def pytest_collectreport(report) -> None:
    """Every test module pytest collected (a module skipped at import included)."""
    if "::" not in report.nodeid and report.nodeid.endswith(".py"):
        _MODULES.append(report.nodeid)


def pytest_collection_finish(session) -> None:
    out = os.environ.get("RLFLOW_CHECK_TESTS_OUT")
    root = os.environ.get("RLFLOW_CHECK_TESTS_ROOT")
    if not out or not root:
        return
    with open(out, "a", encoding="utf-8") as stream:  # a fresh file per collection
        flags = _runs_nothing(session.config)
        if flags:
            stream.write(f"#runs-nothing: {' '.join(flags)}\n")
        base = str(session.config.rootpath)
        for nodeid in _MODULES:
            path = os.path.relpath(os.path.join(base, nodeid), root).replace(os.sep, "/")
            stream.write(f"#module: {path}\n")
        patterns = session.config.getini("python_files")
        stream.write(f"#python_files: {' '.join(patterns)}\n")
        chosen = set(map(id, session.items))
        for item in _ALL:
            if id(item) not in chosen:
                stream.write(f"#deselected: {_name(item, root)}\n")
        for item in session.items:
            stream.write(f"{_name(item, root)}\n")


def _name(item, root: str) -> str:
    rest = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
    return os.path.relpath(str(item.path), root).replace(os.sep, "/") + "::" + rest
