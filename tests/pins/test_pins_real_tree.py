"""check-pins on the real NeMo-RL (7ea279ab) -> Megatron-Bridge (8c46dc42) -> Megatron-LM
(14346b65) tree with its three real uv.lock files (real_tree.py, data/README.md).

The tree is consistent: `uv lock --check --offline` accepts NeMo-RL's lock (checked when the data
was vendored; uv needs Python >=3.13.14 for it, which CI does not have). Issue 24: check-pins said
23 RF010 and 2 RF011 on it. The repositories are built once per module and only read, except by
tests that restore what they change.
"""

from __future__ import annotations

import pytest
from pins_helpers import check_pins
from real_tree import BRIDGE, build


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return build(tmp_path_factory.mktemp("nemo-rl"))


@pytest.fixture(scope="module")
def case_a(tmp_path_factory):
    """The same tree without its uv.lock files: the pyproject level alone (issue 24's case A)."""
    return build(tmp_path_factory.mktemp("nemo-rl-no-locks"), locks=False)


def test_the_real_tree_with_its_real_locks_passes(tree):
    result = check_pins("--repo", tree, "--strict")
    assert result.code == 0, result.out
    assert "ok: 5 pyproject.toml files, 4 submodules, no pin drift" in result.out


def test_the_real_tree_without_locks_passes(case_a):
    result = check_pins("--repo", case_a, "--strict")
    assert result.code == 0, result.out


def edited(tree, old: str, new: str, extra: str = ""):
    path = tree / "pyproject.toml"
    original = path.read_text()
    assert old in original, old
    path.write_text(original.replace(old, new, 1) + extra)
    try:
        return check_pins("--repo", tree, "--format", "json")
    finally:
        path.write_text(original)


# Each verdict below is what `uv lock --check --offline` (uv 0.13.9) said on this tree.
@pytest.mark.parametrize(
    ("old", "new", "stale"),
    [
        ('"zstandard",', '"zstandard",\n  "einops",', True),  # a new dependency
        ("nvrx = [", "nvrx2 = [", True),  # a renamed extra
        ('version = "1.5.4"', 'version = "1.5.5"', True),  # dependency-metadata
        (
            'url = "https://flashinfer.ai/whl/cu130"',
            'url = "https://flashinfer.ai/whl/cu131"',
            True,
        ),
        (  # the same marker, written another way: uv normalizes it
            "\"triton; sys_platform == 'linux' and (platform_machine == 'x86_64' or "
            "platform_machine == 'aarch64')\"",
            "\"triton; (platform_machine == 'aarch64' or platform_machine == 'x86_64') and "
            "sys_platform == 'linux'\"",
            False,
        ),
    ],
)
def test_edits_of_the_real_root_agree_with_uv(tree, old, new, stale):
    result = edited(tree, old, new)
    assert ("RF011" in result.codes()) is stale, result.out


def test_deployed_submodule_lock_is_checked_and_compared(tree):
    """Bridge deployed from its own lock too: that lock is fresh (`==3.12.*` is `>=3.12,<3.13`),
    and the two deployments differ only where NeMo-RL builds from git what Bridge takes from a
    registry (or another commit); not where NeMo-RL decides: TE (its override), torch (its
    index), NVIDIA-index packages (the same releases), versions of registry packages."""
    policy = f'\n[tool.rlflow.pins]\ndeployed-locks = ["{BRIDGE}"]\n'
    result = edited(tree, "[tool.black]", "[tool.black]", policy)
    assert sorted((d["code"], d["package"]) for d in result.json["diagnostics"]) == [
        ("RF010", "causal-conv1d"),
        ("RF010", "fast-hadamard-transform"),
        ("RF010", "mamba-ssm"),
        ("RF010", "nvidia-resiliency-ext"),
    ], result.out
    allow = (
        policy
        + "allow = ["
        + ", ".join(
            f'{{ package = "{p}", code = "RF010", reason = "NeMo-RL builds it from git" }}'
            for p in (
                "causal-conv1d",
                "fast-hadamard-transform",
                "mamba-ssm",
                "nvidia-resiliency-ext",
            )
        )
        + "]\n"
    )
    assert edited(tree, "[tool.black]", "[tool.black]", allow).code == 0
    bridge = tree / BRIDGE / "pyproject.toml"
    original = bridge.read_text()
    bridge.write_text(original.replace('"six>=1.17.0",', '"six>=1.17.0",\n    "einops>=0.8",'))
    try:
        result = edited(tree, "[tool.black]", "[tool.black]", allow)
    finally:
        bridge.write_text(original)
    stale = [d for d in result.json["diagnostics"] if d["code"] == "RF011"]
    assert {d["message"].split("`")[1] for d in stale} == {f"{BRIDGE}/uv.lock", "uv.lock"}


def test_submodule_locks_are_informational_by_default(tree):
    """Bridge's own lock is stale now, but uv never reads it for the root: no finding."""
    lock = tree / BRIDGE / "uv.lock"
    original = lock.read_text()
    lock.write_text(original.replace('requires-python = "==3.12.*"', 'requires-python = ">=3.9"'))
    try:
        result = check_pins("--repo", tree, "--format", "json")
    finally:
        lock.write_text(original)
    assert [c for c in result.codes() if c != "RF008"] == [], result.out
