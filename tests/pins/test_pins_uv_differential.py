"""Differential test against the real uv: check-pins reports conflicting git pins (RF001) for
exactly the packages that `uv lock` says have "conflicting URLs".

A real repository nests two submodules (child-a, which nests child-b); the root requires
child-a by path, child-a requires child-b. Pins of `emerging-optimizers` (and, in the pair
configurations, `fast-hadamard-transform`) point at local `file://` git repositories with
tags, placed at random in the root's dependencies, extras, groups, constraints, overrides and
the children's dependencies, requested or unrequested extras and groups. `uv lock --offline`
runs with a private cache, so the test needs no network.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
from pins_helpers import add_submodule, check_pins, git, make_repo

UV = Path(sysconfig.get_path("scripts")) / "uv"
PACKAGES = {"emerging-optimizers": "emo", "fast-hadamard-transform": "fht"}
TAGS = ("v0.2.0", "v0.3.0")
ROOT_SCOPES = ("dependencies", "extra:mcore", "group:dev", "constraint")
CHILD_SCOPES = ("dependencies", "extra:requested", "extra:unrequested", "group:test")


@dataclass(frozen=True)
class Placement:
    """One pin: which project, which scope, which tag, and how it is spelled."""

    project: str  # "root" | "a" | "b"
    scope: str
    tag: str
    style: str  # "source-rev" | "source-tag" | "url" (a `name @ git+...` requirement)
    slash: bool  # spell the repository URL with a trailing slash (must not matter)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    base = tmp_path_factory.mktemp("uvdiff")
    upstreams = {}
    for package, short in PACKAGES.items():
        repo = make_repo(base / short, {"pyproject.toml": _leaf_toml(package, "0.2.0")})
        git(repo, "tag", "v0.2.0")
        (repo / "pyproject.toml").write_text(_leaf_toml(package, "0.3.0"))
        git(repo, "commit", "-qam", "0.3.0")
        git(repo, "tag", "v0.3.0")
        upstreams[package] = repo
    child_b = make_repo(base / "up-b", {"pyproject.toml": _child_toml("child-b", [])})
    child_a = make_repo(base / "up-a", {"pyproject.toml": _child_toml("child-a", [])})
    add_submodule(child_a, child_b, "child-b")
    root = make_repo(base / "root", {"pyproject.toml": "[project]\nname = 'r'\nversion = '0'\n"})
    add_submodule(root, child_a, "child-a")
    return {"root": root, "upstreams": upstreams, "cache": base / "uv-cache"}


def _leaf_toml(name: str, version: str) -> str:
    return (
        f'[project]\nname = "{name}"\nversion = "{version}"\nrequires-python = ">=3.10"\n\n'
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
    )


def _url(upstream: Path, slash: bool) -> str:
    return f"file://{upstream}" + ("/" if slash else "")


def _child_toml(
    name: str,
    placements: list[tuple[str, Placement]],
    upstreams=None,
    requires_b: str | None = None,
) -> str:
    tables = {
        "deps": [],
        "extras": {"requested": [], "unrequested": []},
        "groups": {"test": []},
        "sources": [],
    }
    if requires_b:
        tables["deps"].append(requires_b)
        tables["sources"].append('child-b = { path = "child-b" }')
    for package, p in placements:
        _place(tables, package, p, upstreams[package])
    lines = [
        f'[project]\nname = "{name}"\nversion = "0.1.0"\nrequires-python = ">=3.10"',
        f"dependencies = {_array(tables['deps'])}",
        "\n[project.optional-dependencies]",
    ]
    lines += [f"{extra} = {_array(reqs)}" for extra, reqs in tables["extras"].items()]
    lines += ["\n[dependency-groups]", f"test = {_array(tables['groups']['test'])}"]
    lines += ["\n[tool.uv.sources]", *tables["sources"]]
    lines += ['\n[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"']
    return "\n".join(lines) + "\n"


def _root_toml(placements: list[tuple[str, Placement]], upstreams, override: str | None) -> str:
    tables = {
        "deps": ["child-a[requested]"],
        "extras": {"mcore": []},
        "groups": {"dev": []},
        "sources": ['child-a = { path = "child-a" }'],
        "constraint": [],
    }
    for package, p in placements:
        _place(tables, package, p, upstreams[package])
    overrides = [f"{override} @ git+{_url(upstreams[override], False)}@v0.2.0"] if override else []
    return (
        "\n".join(
            [
                '[project]\nname = "root"\nversion = "0.1.0"\nrequires-python = ">=3.12"',
                f"dependencies = {_array(tables['deps'])}",
                f"\n[project.optional-dependencies]\nmcore = {_array(tables['extras']['mcore'])}",
                f"\n[dependency-groups]\ndev = {_array(tables['groups']['dev'])}",
                f"\n[tool.uv]\nconstraint-dependencies = {_array(tables['constraint'])}",
                f"override-dependencies = {_array(overrides)}",
                "\n[tool.uv.sources]",
                *tables["sources"],
            ]
        )
        + "\n"
    )


def _place(tables: dict, package: str, p: Placement, upstream: Path) -> None:
    url = _url(upstream, p.slash)
    has_source = any(s.startswith(f"{package} =") for s in tables["sources"])
    if p.style == "url" or p.scope == "constraint" or has_source:  # one source per package
        requirement = f"{package} @ git+{url}@{p.tag}"
    else:
        requirement = package
        key = "tag" if p.style == "source-tag" else "rev"
        tables["sources"].append(f'{package} = {{ git = "{url}", {key} = "{p.tag}" }}')
    kind, _, name = p.scope.partition(":")
    target = {
        "dependencies": tables["deps"],
        "constraint": tables.get("constraint"),
        "extra": tables["extras"].get(name),
        "group": tables["groups"].get(name),
    }[kind]
    target.append(requirement)


def _array(items: list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def _random_config(rng: random.Random, packages: list[str]) -> dict:
    placements = {"root": [], "a": [], "b": []}
    for package in packages:
        for project in placements:
            scopes = ROOT_SCOPES if project == "root" else CHILD_SCOPES
            for scope in rng.sample(scopes, k=rng.choice([0, 1, 1, 2])):
                style = rng.choice(["source-rev", "source-tag", "url"])
                placement = Placement(project, scope, rng.choice(TAGS), style, rng.random() < 0.3)
                placements[project].append((package, placement))
    override = rng.choice(packages) if rng.random() < 0.15 else None
    return {
        "placements": placements,
        "override": override,
        "b_extra": rng.choice(["child-b", "child-b[requested]"]),
    }


def _write(workspace, config: dict) -> None:
    root, upstreams = workspace["root"], workspace["upstreams"]
    p = config["placements"]
    a_requires_b = config["b_extra"]
    (root / "pyproject.toml").write_text(_root_toml(p["root"], upstreams, config["override"]))
    (root / "child-a" / "pyproject.toml").write_text(
        _child_toml("child-a", p["a"], upstreams, requires_b=a_requires_b)
    )
    (root / "child-a" / "child-b" / "pyproject.toml").write_text(
        _child_toml("child-b", p["b"], upstreams)
    )
    (root / "uv.lock").unlink(missing_ok=True)


def uv_lock(workspace, *args: str, offline: bool = True) -> subprocess.CompletedProcess:
    """The real uv, offline, with a private cache and this interpreter (no downloads)."""
    env = {
        **os.environ,
        "UV_CACHE_DIR": str(workspace["cache"]),
        "UV_NO_CONFIG": "1",
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_PYTHON": sys.executable,
    }
    return subprocess.run(
        [str(UV), "lock", "--quiet", *(["--offline"] if offline else []), *args],
        cwd=workspace["root"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _uv_conflicts(workspace) -> tuple[set[str], str]:
    done = uv_lock(workspace)
    conflicts = set(re.findall(r"conflicting URLs for package `([^`]+)`", done.stderr))
    assert done.returncode == 0 or conflicts, f"uv failed for another reason:\n{done.stderr}"
    return conflicts, done.stderr


def _rf001_packages(workspace) -> set[str]:
    result = check_pins("--repo", workspace["root"], "--format", "json")
    assert result.code in (0, 1), result.err
    return {d["package"] for d in result.json["diagnostics"] if d["code"] == "RF001"}


SINGLE = [_random_config(random.Random(seed), ["emerging-optimizers"]) for seed in range(28)]
PAIRS = [_random_config(random.Random(1000 + seed), list(PACKAGES)) for seed in range(8)]


@pytest.mark.parametrize("config", SINGLE, ids=[f"single-{i}" for i in range(len(SINGLE))])
def test_rf001_matches_uv_conflicting_urls(workspace, config):
    _write(workspace, config)
    uv, stderr = _uv_conflicts(workspace)
    assert _rf001_packages(workspace) == uv, f"{config}\nuv said:\n{stderr}"
    if not uv:  # uv accepts it (transitive pins through path deps included): so must --strict
        strict = check_pins("--repo", workspace["root"], "--strict", "--format", "json")
        pins = [c for c in strict.codes() if c != "RF008"]  # RF008: the test's uncommitted edits
        assert pins == [], f"{config}\n{strict.out}"


@pytest.mark.parametrize("config", PAIRS, ids=[f"pair-{i}" for i in range(len(PAIRS))])
def test_uv_conflict_is_one_of_ours_with_two_packages(workspace, config):
    """uv stops at its first conflict, so with two packages its one must be among ours."""
    _write(workspace, config)
    uv, stderr = _uv_conflicts(workspace)
    ours = _rf001_packages(workspace)
    assert uv <= ours and bool(uv) == bool(ours), f"{config}\nuv said:\n{stderr}"


def test_configurations_cover_both_outcomes(workspace):
    """The random configurations are only worth something if uv both accepts and rejects some."""
    outcomes = set()
    for config in SINGLE:
        _write(workspace, config)
        outcomes.add(bool(_uv_conflicts(workspace)[0]))
    assert outcomes == {True, False}


def test_index_trailing_slash_matches_uv(workspace):
    root = workspace["root"]
    index = '[[tool.uv.index]]\nname = "flashinfer"\nurl = "{url}"\nexplicit = true\n'
    (root / "pyproject.toml").write_text(
        '[project]\nname = "root"\nversion = "0.1.0"\nrequires-python = ">=3.12"\n'
        'dependencies = ["child-a", "flashinfer-cubin"]\n\n'
        + index.format(url="https://flashinfer.ai/whl")
        + '\n[tool.uv.sources]\nchild-a = { path = "child-a" }\nflashinfer-cubin = { index = "flashinfer" }\n'
    )
    (root / "child-a" / "pyproject.toml").write_text(
        '[project]\nname = "child-a"\nversion = "0.1.0"\nrequires-python = ">=3.10"\n'
        'dependencies = ["flashinfer-cubin"]\n\n'
        + index.format(url="https://flashinfer.ai/whl/")
        + '\n[tool.uv.sources]\nflashinfer-cubin = { index = "flashinfer" }\n\n'
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
    )
    (root / "uv.lock").unlink(missing_ok=True)
    done = uv_lock(workspace)
    assert "conflicting indexes for package `flashinfer-cubin`" in done.stderr, done.stderr
    result = check_pins("--repo", root, "--format", "json")
    assert "RF003" in result.codes()


# -- issue 11: GitHub case, `!=`, BOM ------------------------------------------------------------
def _simple_root(workspace, root_deps: list[str], child_deps: list[str], extra: str = "") -> None:
    root = workspace["root"]
    (root / "pyproject.toml").write_text(
        '[project]\nname = "root"\nversion = "0.1.0"\nrequires-python = ">=3.12"\n'
        f"dependencies = {_array(['child-a', *root_deps])}\n\n"
        f'[tool.uv.sources]\nchild-a = {{ path = "child-a" }}\n{extra}'
    )
    (root / "child-a" / "pyproject.toml").write_text(
        '[project]\nname = "child-a"\nversion = "0.1.0"\nrequires-python = ">=3.10"\n'
        f"dependencies = {_array(child_deps)}\n\n"
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
    )
    (root / "child-a" / "child-b" / "pyproject.toml").write_text(_child_toml("child-b", []))
    (root / "uv.lock").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def github_alias(workspace, tmp_path_factory):
    """`https://github.com/NVIDIA-NeMo/Emerging-Optimizers` (any case) and a gitlab twin are
    served from the local emerging-optimizers repository through git's `insteadOf`, so the real
    uv fetches them with no network (uv runs git; GitHub's API fast path is turned off)."""
    upstream = workspace["upstreams"]["emerging-optimizers"]
    config = tmp_path_factory.mktemp("gitconfig") / "config"
    lines = [f'[url "file://{upstream}"]']
    for host in ("github.com", "gitlab.com"):
        for spelling in ("NVIDIA-NeMo/Emerging-Optimizers", "nvidia-nemo/emerging-optimizers"):
            lines += [f"\tinsteadOf = https://{host}/{spelling}", ""]
    config.write_text("\n".join(line for line in lines if line) + "\n")
    return config


@pytest.mark.parametrize("host", ["github.com", "gitlab.com"])
def test_url_case_matches_uv(workspace, github_alias, host):
    """uv treats GitHub URLs that differ only in case as one repository; other hosts not."""
    root_req = f"emerging-optimizers @ git+https://{host}/NVIDIA-NeMo/Emerging-Optimizers@v0.3.0"
    source = (
        'emerging-optimizers = { git = "https://'
        + host
        + '/nvidia-nemo/emerging-optimizers", rev = "v0.3.0" }\n'
    )
    _simple_root(workspace, [root_req], ["emerging-optimizers"])
    child = workspace["root"] / "child-a" / "pyproject.toml"
    child.write_text(child.read_text() + "\n[tool.uv.sources]\n" + source)
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": str(github_alias),
        "UV_CACHE_DIR": str(workspace["cache"]),
        "UV_NO_CONFIG": "1",
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_PYTHON": sys.executable,
        "UV_NO_GITHUB_FAST_PATH": "1",
    }
    done = subprocess.run(
        [str(UV), "lock", "--quiet"],
        cwd=workspace["root"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    uv_conflict = "conflicting URLs" in done.stderr
    assert done.returncode == 0 or uv_conflict, done.stderr
    assert uv_conflict is (host == "gitlab.com")
    assert bool(_rf001_packages(workspace)) is uv_conflict


def _wheel(directory: Path, name: str, version: str) -> None:
    """A minimal real wheel (metadata only): enough for uv to resolve against --find-links."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: rlflow-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wheels")
    for version in ("0.2.0", "0.3.0"):
        _wheel(directory, "leaf", version)
    return directory


@pytest.mark.parametrize(
    ("root_spec", "child_spec"),
    [
        ("==0.2.0", "!=0.2.0"),
        ("==0.2", "!=0.2.0"),
        ("==0.2.*", "!=0.2.*"),
        ("==0.2.0", "!=0.3.0"),
        (">=0.2.0", "!=0.2.0"),
        ("==0.3.0", "!=0.2.*"),
    ],
)
def test_exclusions_match_uv(workspace, wheels, root_spec, child_spec):
    """RF004 exactly when uv says the requirements are unsatisfiable (local wheels only)."""
    _simple_root(workspace, [f"leaf{root_spec}"], [f"leaf{child_spec}"])
    # --no-index: only the local wheels, no network (UV_NO_CONFIG hides [tool.uv] settings)
    done = uv_lock(workspace, "--no-index", "--find-links", str(wheels), offline=False)
    unsatisfiable = "No solution found" in done.stderr
    assert done.returncode == 0 or unsatisfiable, done.stderr
    result = check_pins("--repo", workspace["root"], "--format", "json")
    assert ("RF004" in result.codes()) is unsatisfiable, done.stderr


def test_bom_is_accepted_like_uv(workspace):
    _simple_root(workspace, [], [])
    path = workspace["root"] / "pyproject.toml"
    path.write_text("\ufeff" + path.read_text())
    done = uv_lock(workspace)
    assert done.returncode == 0, done.stderr
    result = check_pins("--repo", workspace["root"], "--strict", "--format", "json")
    assert [c for c in result.codes() if c != "RF008"] == [], result.out
