"""The pure pieces of check-pins: version disjointness, URL normalization, TOML line finding."""

from __future__ import annotations

import re

import pytest

from rlflow.pins.lines import TomlLines
from rlflow.pins.urls import normalize_repo, parse_direct_url
from rlflow.pins.versions import disjoint, exact_version


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("==0.6.8.post1", "==0.6.18.post1", True),  # NeMo-RL #4139
        ("==1.0", "==1.0.0", False),  # same version, different spelling
        ("==1.0", "==1.0+cu130", False),  # == without a local label accepts local builds
        (">=1.0", "<2.0", False),
        (">1.0", "<1.0", True),
        (">=2.0", "<2.0", True),
        ("<=2.0", ">=2.0", False),  # exactly 2.0
        ("~=1.2.3", ">=1.3", True),
        ("~=1.2", "==1.9", False),
        ("==1.2.*", "==1.2.7", False),
        ("==1.2.*", "==1.3.0", True),
        ("!=1.0", "==1.0", True),  # uv: "your requirements are unsatisfiable"
        ("!=1.0.0", "==1.0", True),
        ("!=1.1", "==1.0", False),
        ("!=1.0", ">=1.0,<=1.0", True),
        ("!=1.0", ">=1.0", False),
        ("!=1.2.*", "==1.2.*", True),
        ("!=1.2.*", "~=1.2.3", True),
        ("!=1.2.*", "==1.2.7", True),
        ("!=1.2.*", ">=1.2", False),
        (">=5.0,<6", "==5.17.0", False),
        ("===1.0-custom", "==1.0", False),
    ],
)
def test_disjoint(a, b, expected):
    assert disjoint(a, b) is expected
    assert disjoint(b, a) is expected


def test_exact_version():
    assert exact_version("==0.6.18.post1") == "0.6.18.post1"
    assert exact_version("==1.2.*") is None
    assert exact_version(">=1,<2") is None


@pytest.mark.parametrize(
    "spelling",
    [
        "https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git",
        "git+https://github.com/NVIDIA-NeMo/Emerging-Optimizers",
        "https://github.com/NVIDIA-NeMo/Emerging-Optimizers/",
        "https://GitHub.com/NVIDIA-NeMo/Emerging-Optimizers.git/",
        "https://token@github.com/NVIDIA-NeMo/Emerging-Optimizers",
        "https://github.com/nvidia-nemo/emerging-optimizers",  # uv: GitHub is case-insensitive
    ],
)
def test_repository_spellings_normalize_to_one(spelling):
    assert normalize_repo(spelling) == "https://github.com/nvidia-nemo/emerging-optimizers"


def test_case_matters_off_github():
    assert normalize_repo("https://gitlab.com/A/x") != normalize_repo("https://gitlab.com/a/x")


def test_different_repositories_stay_different():
    assert normalize_repo("https://github.com/a/x") != normalize_repo("https://github.com/b/x")
    assert normalize_repo("ssh://git@github.com/a/x") != normalize_repo("https://github.com/a/x")


def test_direct_url_kinds(tmp_path):
    git = parse_direct_url("git+https://github.com/a/b.git@v1#subdirectory=py", str(tmp_path))
    assert (git.kind, git.ref, git.subdirectory) == ("git", "v1", "py")
    assert git.key == "git+https://github.com/a/b@v1#subdirectory=py"
    assert parse_direct_url("https://x.org/a-1.0-py3-none-any.whl", "/").kind == "url"
    local = parse_direct_url(f"file://{tmp_path}/sub/../pkg", "/")
    assert (local.kind, local.key) == ("path", f"path:{tmp_path}/pkg")


TOML = '''\
[project]
dependencies = [
  "a==1",  # [not a header]
  'b @ git+https://x/y@v1',
]
description = """
[fake.header]
"""

[tool.uv.sources]
emerging_optimizers = { git = "https://g/e.git", rev = "v0.2.0" }

[tool.uv.sources.foo]
rev = "v1"

[[tool.uv.index]]
name = "a"

[[tool.uv.index]]
url = "second"
'''


def test_lines_find_keys_values_and_array_tables():
    lines = TomlLines(TOML)
    assert lines.locate(("project", "dependencies", 1), re.compile(r"[\"'](?P<at>)b @")) == (4, 4)
    rev = re.compile(r"\brev\s*=\s*(?P<at>)")
    assert lines.locate(("tool", "uv", "sources", "emerging_optimizers", "rev"), rev) == (11, 56)
    assert lines.locate(("tool", "uv", "sources", "foo", "rev")) == (14, 1)
    assert lines.locate(("tool", "uv", "index", 1, "url")) == (20, 1)
    assert lines.locate(("fake", "header")) == (None, None)  # inside a string, not a table
    assert lines.locate(("tool", "uv", "sources", "missing")) == (10, 2)  # nearest enclosing table
