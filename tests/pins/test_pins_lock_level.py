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
from pins_helpers import add_submodule, check_pins, commit_all, git, line_of, make_repo
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


# -- edits a new user makes, each judged by the real `uv lock --check` -------------------------
def _gitdep(env) -> str:
    """A local git repository with tags v0.2.0 and v0.3.0 (made once per module)."""
    repo = env["base"] / "gitdep"
    if not repo.exists():
        toml = project(env, deps="[]").replace('name = "app"', 'name = "gitdep"')
        make_repo(repo, {"pyproject.toml": toml})
        git(repo, "tag", "v0.2.0")
    return str(repo)


GROUPS = '\n[dependency-groups]\na = ["leaf"]\nb = ["other"]\n'
NEWER = 'exclude-newer = "2025-01-01T00:00:00Z"\n'


def _with_uv(env, setting: str, body: str = "", deps: str = '["leaf"]') -> str:
    return project(env, body, deps=deps).replace("no-index = true\n", f"no-index = true\n{setting}")


def _git_source(env) -> str:
    return project(
        env, f'\n[tool.uv.sources]\ngitdep = {{ git = "file://{_gitdep(env)}", tag = "v0.2.0" }}\n'
    ).replace('dependencies = ["leaf"]', 'dependencies = ["gitdep"]')


def _pinned_local_index(env) -> str:
    return indexed(env).replace("default = true\n", "explicit = true\n") + (
        '\n[tool.uv.sources]\nleaf = { index = "local" }\n'
    )


def _wheel_source(env) -> str:
    return (
        f'\n[tool.uv.sources]\nleaf = {{ path = "{env["wheels"]}/leaf-0.2.0-py3-none-any.whl" }}\n'
    )


# case -> (pyproject, edits of the pyproject, edit of the lock, what uv says: fresh | stale | any)
# "any": rlflow must say RF013 (uv re-resolves, and only the resolution tells).
EDITS = {
    "specifier respelled >=0.2.0": (
        lambda e: project(e, deps='["leaf>=0.2"]'),
        [('"leaf>=0.2"', '"leaf>=0.2.0"')],
        None,
        "fresh",
    ),
    "specifier respelled <1.0": (
        lambda e: project(e, deps='["leaf<1"]'),
        [('"leaf<1"', '"leaf<1.0"')],
        None,
        "fresh",
    ),
    "redundant bound added": (
        lambda e: project(e, deps='["leaf>=0.2,<1"]'),
        [('"leaf>=0.2,<1"', '"leaf>=0.2,<1,>=0.1"')],
        None,
        "fresh",
    ),
    "a lone == pin spelled as a range": (
        lambda e: project(e, deps='["leaf==0.3.0"]'),
        [('"leaf==0.3.0"', '"leaf>=0.3.0,<=0.3.0"')],
        None,
        "stale",
    ),
    "a bound moved below a prerelease": (
        lambda e: project(e, deps='["leaf>=0.2"]'),
        [('"leaf>=0.2"', '"leaf>=0.2a0"')],
        None,
        "stale",
    ),
    "=== respelled": (
        lambda e: project(e, deps='["leaf===0.3.0"]'),
        [('"leaf===0.3.0"', '"leaf===0.3"')],
        None,
        "fresh",
    ),
    "== made ===": (
        lambda e: project(e, deps='["leaf==0.3.0"]'),
        [('"leaf==0.3.0"', '"leaf===0.3.0"')],
        None,
        "stale",
    ),
    "platform_release is a string to uv": (
        lambda e: project(e, deps="[\"leaf; platform_release >= '5'\"]"),
        [("'5'", "'5.0'")],
        None,
        "stale",
    ),
    "a substring test is not an equality": (
        lambda e: project(e, deps="[\"leaf; 'arm' in platform_machine\"]"),
        [("'arm' in platform_machine", "platform_machine == 'arm'")],
        None,
        "stale",
    ),
    "a requirement split in two": (
        lambda e: project(e, deps='["leaf>=0.1,<0.4"]'),
        [('["leaf>=0.1,<0.4"]', '["leaf>=0.1", "leaf<0.4"]')],
        None,
        "fresh",
    ),
    "one package under complementary markers": (
        lambda e: project(
            e, deps="[\"leaf; sys_platform == 'linux'\", \"leaf; sys_platform != 'linux'\"]"
        ),
        [
            (
                "[\"leaf; sys_platform == 'linux'\", \"leaf; sys_platform != 'linux'\"]",
                '["leaf"]',
            )
        ],
        None,
        "fresh",
    ),
    "a requirement whose marker never holds removed": (
        lambda e: project(e, deps='["leaf", "other; python_version < \'3.12\'"]'),
        [(", \"other; python_version < '3.12'\"", "")],
        None,
        "stale",
    ),
    "a constraint with no specifier added": (
        project,
        [("no-index = true\n", 'no-index = true\nconstraint-dependencies = ["leaf"]\n')],
        None,
        "fresh",
    ),
    "a constraint split in two": (
        lambda e: _with_uv(e, 'constraint-dependencies = ["leaf>=0.1,<0.3"]\n'),
        [('["leaf>=0.1,<0.3"]', '["leaf>=0.1", "leaf<0.3"]')],
        None,
        "fresh",
    ),
    "dependency-metadata requirement respelled": (
        lambda e: project(
            e, METADATA.replace("requires-dist = []", 'requires-dist = ["other>=1"]')
        ),
        [('"other>=1"', '"other>=1.0"')],
        None,
        "fresh",
    ),
    "~= precision changed": (
        lambda e: project(e, deps='["leaf~=0.3"]'),
        [('"leaf~=0.3"', '"leaf~=0.3.0"')],
        None,
        "any",
    ),
    "wildcard precision changed": (
        lambda e: project(e, deps='["leaf==0.3.*"]'),
        [('"leaf==0.3.*"', '"leaf==0.3.0.*"')],
        None,
        "any",
    ),
    "requires-python gains a hole": (
        project,
        [('requires-python = ">=3.12"', 'requires-python = ">=3.12,!=3.13.*"')],
        None,
        "fresh",
    ),
    "requires-python lower bound made exclusive": (
        project,
        [('requires-python = ">=3.12"', 'requires-python = ">3.11.99"')],
        None,
        "stale",
    ),
    "empty group added": (
        lambda e: project(e, GROUPS),
        [('b = ["other"]', 'b = ["other"]\nz = []')],
        None,
        "stale",
    ),
    "empty group removed": (
        lambda e: project(e, GROUPS + "z = []\n"),
        [("z = []\n", "")],
        None,
        "stale",
    ),
    "empty group added to a virtual root": (
        lambda e: project(e, GROUPS).replace(
            '[project]\nname = "app"\nversion = "0.1.0"\nrequires-python = ">=3.12"\n'
            'dependencies = ["leaf"]\n',
            "",
        ),
        [('b = ["other"]', 'b = ["other"]\nz = []')],
        None,
        "fresh",
    ),
    "empty legacy dev-dependencies added": (
        project,
        [("no-index = true\n", "no-index = true\ndev-dependencies = []\n")],
        None,
        "stale",
    ),
    "default-groups changed": (
        lambda e: _with_uv(e, 'default-groups = ["a"]\n', GROUPS),
        [('default-groups = ["a"]', 'default-groups = ["b"]')],
        None,
        "stale",
    ),
    "default-groups added": (
        lambda e: project(e, GROUPS),
        [("no-index = true\n", 'no-index = true\ndefault-groups = ["a", "b"]\n')],
        None,
        "stale",
    ),
    "default-groups reordered": (
        lambda e: _with_uv(e, 'default-groups = ["a", "b"]\n', GROUPS),
        [('["a", "b"]', '["b", "a"]')],
        None,
        "fresh",
    ),
    "default-groups set to uv's default": (
        lambda e: project(e, GROUPS.replace("a =", "dev =")),
        [("no-index = true\n", 'no-index = true\ndefault-groups = ["dev"]\n')],
        None,
        "fresh",
    ),
    "a revision 4 lock has no default-groups": (
        lambda e: _with_uv(e, 'default-groups = ["a"]\n', GROUPS),
        [],
        lambda lock: lock.replace("revision = 5\n", "revision = 4\n").replace(
            'default-groups = ["a"]\n', ""
        ),
        "fresh",
    ),
    "exclude-newer moved later": (
        lambda e: _with_uv(e, NEWER),
        [("2025-01-01T00:00:00Z", "2025-02-01T00:00:00Z")],
        None,
        "fresh",
    ),
    "exclude-newer as the same day's date": (
        lambda e: _with_uv(e, NEWER),
        [("2025-01-01T00:00:00Z", "2024-12-31")],
        None,
        "fresh",
    ),
    "exclude-newer moved earlier": (
        lambda e: _with_uv(e, NEWER),
        [("2025-01-01T00:00:00Z", "2025-01-01T00:00:00+01:00")],
        None,
        "stale",
    ),
    "exclude-newer removed": (lambda e: _with_uv(e, NEWER), [(NEWER, "")], None, "stale"),
    "exclude-newer as a span, respelled": (
        lambda e: _with_uv(e, 'exclude-newer = "1 week"\n'),
        [("1 week", "P1W")],
        None,
        "fresh",
    ),
    "exclude-newer as another span of the same length": (
        lambda e: _with_uv(e, 'exclude-newer = "1 week"\n'),
        [("1 week", "7 days")],
        None,
        "stale",
    ),
    "exclude-newer from a span to a timestamp": (
        lambda e: _with_uv(e, 'exclude-newer = "1 week"\n'),
        [("1 week", "2025-01-01T00:00:00Z")],
        None,
        "stale",
    ),
    "exclude-newer-package added": (
        project,
        [
            (
                "no-index = true\n",
                'no-index = true\nexclude-newer-package = { leaf = "2025-01-01" }\n',
            )
        ],
        None,
        "stale",
    ),
    "exclude-newer-package for a package not locked": (
        project,
        [
            (
                "no-index = true\n",
                'no-index = true\nexclude-newer-package = { zzz = "2025-01-01" }\n',
            )
        ],
        None,
        "fresh",
    ),
    "dependency-metadata version respelled": (
        lambda e: project(e, METADATA),
        [('version = "0.3.0"\nrequires-dist', 'version = "0.3"\nrequires-dist')],
        None,
        "fresh",
    ),
    "find-links made relative": (
        project,
        [(lambda e: f'find-links = ["{e["wheels"]}"]', 'find-links = ["../wheels"]')],
        None,
        "stale",
    ),
    "an index pinned by name, its URL a local directory": (_pinned_local_index, [], None, "fresh"),
    "git URL gains .git": (
        _git_source,
        [(lambda e: f'file://{_gitdep(e)}"', lambda e: f'file://{_gitdep(e)}.git"')],
        None,
        "stale",
    ),
    "git URL gains a trailing slash": (
        _git_source,
        [(lambda e: f'file://{_gitdep(e)}"', lambda e: f'file://{_gitdep(e)}/"')],
        None,
        "stale",
    ),
    "no-sources added where a source is set": (
        lambda e: project(e, _wheel_source(e)),
        [("no-index = true\n", "no-index = true\nno-sources = true\n")],
        None,
        "stale",
    ),
    "a lock written with no-sources": (
        lambda e: _with_uv(e, "no-sources = true\n", _wheel_source(e)),
        [],
        None,
        "fresh",
    ),
    "git source gains lfs = true": (
        _git_source,
        [('tag = "v0.2.0" }', 'tag = "v0.2.0", lfs = true }')],
        None,
        "stale",
    ),
    "a revision uv cannot read": (project, [], ("revision = 5\n", 'revision = "5"\n'), "error"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_edit_is_judged_as_uv_judges_it(env, case):
    make, edits, lock_edit, expected = EDITS[case]
    files = {"pyproject.toml": make(env)}
    root = locked(env, files)
    path = root / "pyproject.toml"
    text = path.read_text()
    for old, new in edits:
        old, new = (x(env) if callable(x) else x for x in (old, new))
        assert old in text, (old, text)
        text = text.replace(old, new, 1)
    path.write_text(text)
    lock = root / "uv.lock"
    if callable(lock_edit):
        lock.write_text(lock_edit(lock.read_text()))
    elif lock_edit:
        assert lock_edit[0] in lock.read_text()
        lock.write_text(lock.read_text().replace(*lock_edit, 1))
    rc, codes, stderr = verdict(env, root)
    said = {0: "fresh", 1: "stale"}.get(rc, "error")
    if expected != "any":
        assert said == expected, (case, stderr)
    if expected == "fresh":
        assert "RF011" not in codes and "RF013" not in codes, codes
    elif expected == "any":
        assert codes == ["RF013"], codes
    else:
        assert "RF011" in codes, codes


@pytest.mark.parametrize(
    ("setting", "old", "new"),
    [
        ('override-dependencies = ["leaf==0.2.0"]\n', "leaf==0.2.0", "leaf==0.3.0"),
        ('constraint-dependencies = ["leaf<0.3"]\n', "leaf<0.3", "leaf<0.4"),
        ('fork-strategy = "requires-python"\n', '"requires-python"', '"fewest"'),
        ("environments = [\"sys_platform == 'linux'\"]\n", "'linux'", "'darwin'"),
    ],
)
def test_rf011_points_at_the_setting_that_changed(env, setting, old, new):
    """The finding names the change and the line that made it (not `dependencies = ["leaf"]`,
    which names the same package), and the command that fixes it."""
    root = locked(env, {"pyproject.toml": _with_uv(env, setting)})
    path = root / "pyproject.toml"
    path.write_text(path.read_text().replace(old, new, 1))
    rc, _, _ = verdict(env, root)
    assert rc == 1
    (finding,) = check_pins("--repo", root, "--format", "json").json["diagnostics"]
    assert finding["code"] == "RF011" and finding["file"] == "pyproject.toml"
    assert finding["line"] == line_of(path, setting.split(" =")[0]), finding
    assert setting.split(" =")[0] in finding["message"] and "`uv lock`" in finding["help"]


def test_a_path_dependency_that_is_gone_is_rf013(env):
    """uv cannot lock without the project (exit 2); rlflow cannot tell either, and says so,
    naming the path, rather than calling the lock stale ("path" against "directory")."""
    lib = project(env, deps='["other"]').replace('name = "app"', 'name = "lib"')
    toml = project(env, '\n[tool.uv.sources]\nlib = { path = "lib" }\n', deps='["lib"]')
    root = locked(env, {"pyproject.toml": toml, "lib/pyproject.toml": lib})
    shutil.rmtree(root / "lib")
    rc, codes, _ = verdict(env, root)
    assert rc == 2 and codes == ["RF013"], codes
    (finding,) = check_pins("--repo", root, "--format", "json").json["diagnostics"]
    assert "`lib`" in finding["message"] and str(root) not in finding["message"], finding


def test_a_member_directory_without_pyproject_is_rf013(env):
    """A directory that matches `members` but has no pyproject.toml: uv skips an empty one (a
    submodule not checked out) and refuses the workspace otherwise (exit 2), unless its files
    are gitignored; rlflow says it cannot tell, and why, never "ok"."""
    toml = project(env, '\n[tool.uv.workspace]\nmembers = ["packages/*"]\n')
    root = locked(env, {"pyproject.toml": toml, "packages/member/pyproject.toml": MEMBER})
    (root / "packages" / "empty").mkdir()
    (root / "packages" / "notes.txt").write_text("a file matching the glob is no member\n")
    rc, codes, _ = verdict(env, root)
    assert rc == 0 and codes == [], codes
    (root / "packages" / "docs").mkdir()
    (root / "packages" / "docs" / "README").write_text("not a project\n")
    rc, codes, stderr = verdict(env, root)
    assert rc == 2 and "missing a `pyproject.toml`" in stderr, stderr
    assert codes == ["RF013"], codes
    (finding,) = check_pins("--repo", root, "--format", "json").json["diagnostics"]
    assert "`packages/docs`" in finding["message"] and "exclude" in finding["message"]


def test_a_url_source_with_a_fragment_is_rf013(env):
    """uv refuses `url = "...#egg=leaf"` in [tool.uv.sources] (exit 2, before any download);
    rlflow used to drop the fragment and say "ok"."""
    root = locked(env, {"pyproject.toml": project(env, _wheel_source(env))})
    path = root / "pyproject.toml"
    text = path.read_text()
    old = f'{{ path = "{env["wheels"]}/leaf-0.2.0-py3-none-any.whl" }}'
    assert old in text
    path.write_text(text.replace(old, '{ url = "https://example.invalid/leaf.whl#egg=leaf" }'))
    rc, codes, stderr = verdict(env, root)
    assert rc == 2 and "Fragments are not allowed" in stderr, stderr
    assert codes == ["RF013"], codes


@pytest.fixture(scope="session")
def git_lfs() -> None:
    """uv locks `lfs = true` only with git-lfs installed: installed here as the Slurm tests
    install their packages (apt-get, as root, on first use); skipped where that cannot run."""
    if shutil.which("git-lfs"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("git-lfs is not installed and apt-get cannot install it (not root)")
    quiet = {"capture_output": True, "text": True}
    for command in (["apt-get", "-q", "update"], ["apt-get", "-q", "-y", "install", "git-lfs"]):
        done = subprocess.run(["timeout", "300", *command], **quiet)
        if done.returncode != 0:
            pytest.skip(f"`{' '.join(command)}` failed: {done.stderr.strip()[-300:]}")


def test_a_git_lfs_source_locked_by_uv_is_fresh(env, git_lfs):
    """uv records `lfs = true` in the lock's git URL (`?lfs=true&tag=...`)."""
    toml = _git_source(env).replace('tag = "v0.2.0" }', 'tag = "v0.2.0", lfs = true }')
    root = locked(env, {"pyproject.toml": toml})
    assert "lfs=true" in (root / "uv.lock").read_text()
    rc, codes, stderr = verdict(env, root)
    assert rc == 0, stderr
    assert codes == [], codes


def test_a_member_deleted_from_disk_is_rf011(env):
    """The members glob no longer finds `member`: the workspace changed, so the lock is stale
    for certain (uv: exit 1), although the deleted project itself cannot be read."""
    toml = project(env, '\n[tool.uv.workspace]\nmembers = ["packages/*"]\n')
    root = locked(env, {"pyproject.toml": toml, "packages/member/pyproject.toml": MEMBER})
    shutil.rmtree(root / "packages" / "member")
    rc, codes, stderr = verdict(env, root)
    assert rc == 1, stderr
    assert codes == ["RF011"], codes


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        ('a = ["leaf"]', 'a = ["leaf", { include-group = "b" }]', "a cycle: `a` -> `b` -> `a`"),
        ('a = ["leaf"]', 'a = ["leaf", { include-group = "a" }]', "a cycle: `a` -> `a`"),
        ('{ include-group = "a" }', '{ include-group = "zz" }', "`b` includes `zz`"),
    ],
)
def test_malformed_dependency_groups_are_rf013(env, old, new, why):
    """uv refuses cyclic or dangling `include-group`s (exit 2); rlflow used to call such a
    lock fresh (or stale) and now says why it cannot tell."""
    toml = project(
        env, '\n[dependency-groups]\na = ["leaf"]\nb = [{ include-group = "a" }, "other"]\n'
    )
    root = locked(env, {"pyproject.toml": toml})
    path = root / "pyproject.toml"
    path.write_text(path.read_text().replace(old, new, 1))
    rc, codes, stderr = verdict(env, root)
    assert rc == 2 and "malformed dependency groups" in stderr, stderr
    assert codes == ["RF013"], codes
    (finding,) = check_pins("--repo", root, "--format", "json").json["diagnostics"]
    assert why in finding["message"], finding["message"]
