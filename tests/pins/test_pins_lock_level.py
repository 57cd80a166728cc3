"""The lock level against the real uv: for each case of issue 24, a project that the real
`uv lock` has just locked (offline, from local wheels), perhaps changed afterwards; the real
`uv lock --check` decides whether the lock is stale, and check-pins must say RF011 exactly then.

Fresh locks that rlflow used to call stale: `include-group`, `requires-python = ">=3.12,<3.13"`
(uv records `==3.12.*`), `{ workspace = true }`, a source list split by markers. Stale locks it
used to call fresh: a `version = 2` lock, a changed dependency-metadata, a moved index URL, a new
project version, a renamed extra, a requirement moved from an extra into the dependencies. Plus
the policy: RF011 can be allowed by code, `lock-level = false` turns the level off, and a
find-links directory spelled relative in one lock and absolute in a deployed submodule's is no
RF010.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from pins_helpers import add_submodule, check_pins, commit_all, git, make_repo
from test_pins_uv_differential import UV, _wheel

HATCH = '\n[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("lock-level")
    wheels = base / "wheels"
    wheels.mkdir()
    for name, version in (("leaf", "0.2.0"), ("leaf", "0.3.0"), ("other", "1.0")):
        _wheel(wheels, name, version)
    shutil.copytree(wheels, base / "wheels-moved")
    uv_env = {
        **os.environ,
        "UV_CACHE_DIR": str(base / "uv-cache"),
        "XDG_CONFIG_HOME": str(base / "xdg"),  # no user uv.toml (UV_NO_CONFIG would also hide
        "UV_PYTHON_DOWNLOADS": "never",  # the project's [tool.uv] settings)
        "UV_PYTHON": sys.executable,
        "UV_OFFLINE": "1",
    }
    return {"base": base, "wheels": wheels, "env": uv_env, "n": [0]}


def uv(env, cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(UV), *args, "--quiet"],
        cwd=cwd,
        env=env["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def project(
    env,
    body: str = "",
    deps: str = '["leaf"]',
    version: str = "0.1.0",
    python: str = ">=3.12",
    extra_files: dict | None = None,
    package: bool = True,
) -> str:
    return (
        f'[project]\nname = "app"\nversion = "{version}"\nrequires-python = "{python}"\n'
        f"dependencies = {deps}\n{body}\n"
        f'[tool.uv]\nfind-links = ["{env["wheels"]}"]\nno-index = true\n'
        + (HATCH if package else "")
    )


def locked(env, files: dict[str, str]):
    env["n"][0] += 1
    root = make_repo(env["base"] / f"case-{env['n'][0]}", files)
    done = uv(env, root, "lock")
    assert done.returncode == 0, done.stderr
    commit_all(root, "lock")
    return root


def verdict(env, root) -> tuple[int, list[str], str]:
    check = uv(env, root, "lock", "--check")
    result = check_pins("--repo", root, "--format", "json")
    assert result.code in (0, 1), result.err
    return check.returncode, result.codes(), check.stderr


FRESH = {
    "include-group": lambda e: project(
        e, '\n[dependency-groups]\na = ["leaf"]\nb = [{ include-group = "a" }, "other"]\n'
    ),
    "requires-python range": lambda e: project(e, python=">=3.12,<3.13"),
    "workspace source": lambda e: project(
        e,
        "\n[tool.uv.sources]\nmember = { workspace = true }\n\n"
        '[tool.uv.workspace]\nmembers = ["packages/*"]\n',
        deps='["member"]',
    ),
    "marker-split source list": lambda e: project(
        e,
        "\n[tool.uv.sources]\nleaf = [\n"
        f'  {{ path = "{e["wheels"]}/leaf-0.2.0-py3-none-any.whl", marker = "sys_platform == \'linux\'" }},\n'
        f'  {{ path = "{e["wheels"]}/leaf-0.3.0-py3-none-any.whl", marker = "sys_platform != \'linux\'" }},\n'
        "]\n",
    ),
}
MEMBER = (
    '[project]\nname = "member"\nversion = "1.0"\nrequires-python = ">=3.12"\ndependencies = ["other"]\n'
    + HATCH
)


@pytest.mark.parametrize("case", list(FRESH))
def test_fresh_lock_is_no_rf011(env, case):
    files = {"pyproject.toml": FRESH[case](env)}
    if case == "workspace source":
        files["packages/member/pyproject.toml"] = MEMBER
    root = locked(env, files)
    rc, codes, stderr = verdict(env, root)
    assert rc == 0, stderr
    assert "RF011" not in codes and "RF013" not in codes, codes


METADATA = (
    '\n[[tool.uv.dependency-metadata]]\nname = "leaf"\nversion = "0.3.0"\nrequires-dist = []\n'
)
EXTRA = '\n[project.optional-dependencies]\nx = ["other"]\n'


def indexed(env) -> str:
    """The wheels as a flat [[tool.uv.index]] instead of find-links."""
    return project(env).replace(
        f'find-links = ["{env["wheels"]}"]\nno-index = true\n',
        f'\n[[tool.uv.index]]\nname = "local"\nurl = "{env["wheels"]}"\nformat = "flat"\n'
        "default = true\n",
    )


# case -> (pyproject, edits of the pyproject after locking, edit of the lock)
STALE = {
    "lock schema version 2": (project, [], ("version = 1\n", "version = 2\n")),
    "dependency-metadata changed": (
        lambda e: project(e, METADATA),
        [("requires-dist = []", 'requires-dist = ["other"]')],
        None,
    ),
    "index URL moved": (indexed, [('wheels"\nformat', 'wheels-moved"\nformat')], None),
    "new project version": (project, [('version = "0.1.0"', 'version = "0.2.0"')], None),
    "extra renamed": (lambda e: project(e, EXTRA), [("\nx = [", "\ny = [")], None),
    "moved from an extra into dependencies": (
        lambda e: project(e, EXTRA),
        [
            ('dependencies = ["leaf"]', 'dependencies = ["leaf", "other"]'),
            ('x = ["other"]', "x = []"),
        ],
        None,
    ),
}


@pytest.mark.parametrize("case", list(STALE))
def test_stale_lock_is_rf011(env, case):
    make, edits, lock_edit = STALE[case]
    root = locked(env, {"pyproject.toml": make(env)})
    path = root / "pyproject.toml"
    text = path.read_text()
    for old, new in edits:
        assert old in text, (old, text)
        text = text.replace(old, new, 1)
    path.write_text(text)
    if lock_edit:
        lock = root / "uv.lock"
        lock.write_text(lock.read_text().replace(*lock_edit, 1))
    rc, codes, stderr = verdict(env, root)
    assert rc != 0, f"uv calls it fresh: {case}"
    assert "RF011" in codes, codes


def test_rf011_can_be_allowed_and_the_lock_level_turned_off(env):
    root = locked(env, {"pyproject.toml": project(env)})
    path = root / "pyproject.toml"
    stale = path.read_text().replace('version = "0.1.0"', 'version = "0.2.0"')
    allow = '\n[tool.rlflow.pins]\nallow = [{ code = "RF011", reason = "re-locked nightly" }]\n'
    path.write_text(stale + allow)
    result = check_pins("--repo", root)
    assert result.code == 0, result.out
    assert "allowed[RF011]" in result.out and "re-locked nightly" in result.out
    path.write_text(stale + "\n[tool.rlflow.pins]\nlock-level = false\n")
    result = check_pins("--repo", root, "--strict", "--format", "json")
    assert [c for c in result.codes() if c != "RF008"] == [], result.out
    path.write_text(stale + "\n[tool.rlflow.pins]\nlock-level = 1\n")
    bad = check_pins("--repo", root)
    assert bad.code == 2 and "`lock-level` must be true or false" in bad.err


def test_find_links_relative_and_absolute_are_one_source(env):
    """A deployed submodule locks from the same find-links directory, spelled absolute; the root
    spells it relative. Same packages, same files: no RF010."""
    child = make_repo(
        env["base"] / "up-child",
        {"pyproject.toml": project(env).replace('name = "app"', 'name = "child"')},
    )
    assert uv(env, child, "lock").returncode == 0
    commit_all(child, "lock")
    rel = os.path.relpath(env["wheels"], env["base"] / "deployed")
    root_toml = project(
        env,
        '\n[tool.uv.sources]\nchild = { path = "child" }\n\n'
        '[tool.rlflow.pins]\ndeployed-locks = ["child"]\n',
        deps='["child", "leaf"]',
    ).replace(f'find-links = ["{env["wheels"]}"]', f'find-links = ["{rel}"]')
    root = make_repo(env["base"] / "deployed", {"pyproject.toml": root_toml})
    add_submodule(root, child, "child")
    done = uv(env, root, "lock")
    assert done.returncode == 0, done.stderr
    commit_all(root, "lock")
    ours, theirs = (root / "uv.lock").read_text(), (root / "child" / "uv.lock").read_text()
    assert f'registry = "{rel}"' in ours or 'registry = "../' in ours, ours[:2000]
    assert f'registry = "{env["wheels"]}"' in theirs
    assert uv(env, root, "lock", "--check").returncode == 0
    result = check_pins("--repo", root, "--strict", "--format", "json")
    assert result.code == 0, result.out
    git(root, "status")
