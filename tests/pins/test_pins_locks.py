"""Lock-level checks against the real uv: RF011 (stale uv.lock) agrees with `uv lock --check`,
RF010 reports a package that the root's and a submodule's uv.lock resolve to different commits.

A real repository: root -> child-a (submodule, path dependency, with its own uv.lock). The
upstream emerging-optimizers is a local git repository with tags v0.2.0, v0.3.0 and a branch.
uv runs offline with a private cache (file:// git fetches need no network).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pins_helpers import add_submodule, check_pins, commit_all, git, make_repo
from test_pins_uv_differential import UV, _leaf_toml

CHILD = """\
[project]
name = "child-a"
version = "0.1.0"
requires-python = ">=3.10"
dependencies = ["emerging-optimizers"]

[tool.uv.sources]
emerging-optimizers = {{ git = "{url}", {ref} }}

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"
"""

ROOT = """\
[project]
name = "root"
version = "0.1.0"
requires-python = ">=3.12"
dependencies = ["child-a", "emerging-optimizers"]

[tool.uv.sources]
child-a = {{ path = "child-a" }}
emerging-optimizers = {{ git = "{url}", {ref} }}
"""


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    base = tmp_path_factory.mktemp("locks")
    emo = make_repo(base / "emo", {"pyproject.toml": _leaf_toml("emerging-optimizers", "0.2.0")})
    git(emo, "tag", "v0.2.0")
    (emo / "pyproject.toml").write_text(_leaf_toml("emerging-optimizers", "0.3.0"))
    git(emo, "commit", "-qam", "0.3.0")
    git(emo, "tag", "v0.3.0")
    url = f"file://{emo}"
    child = make_repo(
        base / "up-child", {"pyproject.toml": CHILD.format(url=url, ref='rev = "v0.3.0"')}
    )
    root = make_repo(base / "root", {"pyproject.toml": ROOT.format(url=url, ref='rev = "v0.3.0"')})
    add_submodule(root, child, "child-a")
    env = {
        **os.environ,
        "UV_CACHE_DIR": str(base / "uv-cache"),
        "UV_NO_CONFIG": "1",
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_PYTHON": sys.executable,
    }
    state = {"root": root, "emo": emo, "url": url, "env": env}
    for directory in (root / "child-a", root):
        assert uv(state, "lock", cwd=directory).returncode == 0
    git(root / "child-a", "add", "uv.lock")
    git(root / "child-a", "commit", "-qm", "lock")
    commit_all(root, "locks")
    return state


def uv(state, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(UV), *args, "--offline", "--quiet"],
        cwd=cwd or state["root"],
        env=state["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_fresh_locks_are_quiet(locked):
    result = check_pins("--repo", locked["root"], "--strict", "--format", "json")
    assert result.code == 0, result.out


MUTATIONS = {
    "nothing": lambda t: t,
    "comment and spacing": lambda t: "# a comment\n" + t.replace(" = ", "  =  ", 1),
    "rev moved": lambda t: t.replace('rev = "v0.3.0"', 'rev = "v0.2.0"'),
    "rev to tag": lambda t: t.replace('rev = "v0.3.0"', 'tag = "v0.3.0"'),
    "new extra": lambda t: t + '\n[project.optional-dependencies]\nx = ["child-a"]\n',
    "new group": lambda t: t + '\n[dependency-groups]\ndev = ["emerging-optimizers"]\n',
    "requires-python": lambda t: t.replace('">=3.12"', '">=3.11"'),
    "constraint": lambda t: t + '\n[tool.uv]\nconstraint-dependencies = ["child-a<1"]\n',
    "override": lambda t: t + '\n[tool.uv]\noverride-dependencies = ["child-a>=0.1"]\n',
    "dependency dropped": lambda t: t.replace(', "emerging-optimizers"]', "]", 1),
    "specifier": lambda t: t.replace('["child-a",', '["child-a>=0.1",'),
    "extras": lambda t: t.replace('["child-a",', '["child-a[x]",'),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_rf011_matches_uv_lock_check(locked, mutation):
    path = locked["root"] / "pyproject.toml"
    original = path.read_text()
    try:
        path.write_text(MUTATIONS[mutation](original))
        done = uv(locked, "lock", "--check")
        result = check_pins("--repo", locked["root"], "--format", "json")
    finally:
        path.write_text(original)
    uv_stale = done.returncode != 0
    assert uv_stale or "out of date" not in done.stderr, done.stderr
    if mutation in ("nothing", "comment and spacing"):
        assert not uv_stale
    if mutation in ("rev moved", "new extra", "new group", "constraint", "dependency dropped"):
        assert uv_stale
    assert ("RF011" in result.codes()) is uv_stale, f"uv: {done.stderr}\nours: {result.out}"


def test_rf011_for_a_changed_path_dependency(locked):
    """uv re-reads child-a's pyproject: a new requirement there makes the root lock stale too."""
    path = locked["root"] / "child-a" / "pyproject.toml"
    original = path.read_text()
    try:
        path.write_text(
            original.replace('["emerging-optimizers"]', '["emerging-optimizers", "root"]')
        )
        done = uv(locked, "lock", "--check")
        result = check_pins("--repo", locked["root"], "--format", "json")
    finally:
        path.write_text(original)
    assert done.returncode != 0
    rf011 = {
        d["message"].split("`")[1]: d for d in result.json["diagnostics"] if d["code"] == "RF011"
    }
    root_lock = rf011["uv.lock"]
    assert "`child-a` (`child-a`)" in root_lock["message"] and "`root`" in root_lock["message"]
    assert (
        root_lock["severity"] == "error"
        and root_lock["help"] == "run `uv lock` (then commit the lock)"
    )
    # child-a's own lock is stale too, but uv never reads it for the root: informational
    assert "child-a/uv.lock" not in rf011


def test_rf010_root_and_submodule_lock_different_commits(locked, tmp_path):
    """Both follow branch `main`, locked at different times: same pins, two commits."""
    root, emo, url = locked["root"], locked["emo"], locked["url"]
    saved = {p: p.read_bytes() for p in (root / "pyproject.toml", root / "uv.lock")}
    child = root / "child-a"
    child_saved = {p: p.read_bytes() for p in (child / "pyproject.toml", child / "uv.lock")}
    try:
        (child / "pyproject.toml").write_text(CHILD.format(url=url, ref='branch = "main"'))
        assert uv(locked, "lock", cwd=child).returncode == 0
        (emo / "README").write_text("new\n")
        git(emo, "add", "README")
        git(emo, "commit", "-qm", "main moves on")
        (root / "pyproject.toml").write_text(
            ROOT.format(url=url, ref='branch = "main"')
            + '\n[tool.rlflow.pins]\ndeployed-locks = ["child-a"]\n'
        )
        done = subprocess.run(
            [str(UV), "lock", "--quiet"],
            cwd=root,
            env=locked["env"],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        result = check_pins("--repo", root, "--format", "json")
        rf010 = [d for d in result.json["diagnostics"] if d["code"] == "RF010"]
        assert [d["package"] for d in rf010] == ["emerging-optimizers"], result.out
        assert rf010[0]["file"] == "uv.lock" and rf010[0]["line"]
        assert "child-a/uv.lock" in rf010[0]["message"] and "deployed-locks" in rf010[0]["message"]
        # Without the policy the child's lock is informational: uv never reads it for the root.
        (root / "pyproject.toml").write_text(ROOT.format(url=url, ref='branch = "main"'))
        quiet = check_pins("--repo", root, "--format", "json")
        assert "RF010" not in quiet.codes(), quiet.out
    finally:
        for p, data in {**saved, **child_saved}.items():
            p.write_bytes(data)
        git(emo, "reset", "-q", "--hard", "HEAD~1")
