"""The expert-parallel and router-replay rules (rlflow/recipe/allocation.py): the dry run and
train's setup refuse the same recipes, with the same code; an MoE recipe with EP > 1 passes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.recipe import load_checked
from rlflow.recipe.allocation import allocation_diagnostics, check_allocation

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = str(ROOT / ".venv" / "bin" / "rlflow")
DENSE = ROOT / "recipes" / "tiny-qwen3-text-1n1g-cpu.yaml"
MOE = ROOT / "recipes" / "tiny-qwen3-moe-text-1n1g-cpu.yaml"
VL_MOE = ROOT / "recipes" / "tiny-qwen3vl-moe-clevr-1n1g-cpu.yaml"


def codes(recipe: Path, overrides: list[str], gpus: int) -> list[str]:
    loaded = load_checked(recipe, overrides)
    return [d.code for d in allocation_diagnostics(loaded, 1, gpus)]


def test_expert_parallel_splits_an_moe_model(tmp_path):
    assert codes(MOE, ["parallelism.expert_parallel_size=2"], 2) == []
    assert codes(MOE, ["parallelism.expert_parallel_size=8"], 8) == []
    assert codes(VL_MOE, ["parallelism.expert_parallel_size=4"], 4) == []
    tp_ep = ["parallelism.expert_parallel_size=2", "parallelism.tensor_parallel_size=2"]
    assert codes(MOE, tp_ep, 4) == ["allocation.expert-and-tensor-parallel"]  # not yet


@pytest.mark.parametrize(
    "recipe, overrides, gpus, code",
    [
        (DENSE, ["parallelism.expert_parallel_size=2"], 2, "allocation.expert-parallel-dense"),
        (MOE, ["parallelism.expert_parallel_size=3"], 3, "allocation.expert-parallel-experts"),
        (VL_MOE, ["parallelism.expert_parallel_size=8"], 8, "allocation.expert-parallel-experts"),
        (MOE, ["generation.backend=hf"], 1, "allocation.router-replay-backend"),
        (MOE, ["parallelism.expert_parallel_size=2"], 3, "allocation.parallel-sizes"),
    ],
)
def test_refused_alike_by_dry_run_and_setup(recipe, overrides, gpus, code, tmp_path):
    dry = subprocess.run(
        [RLFLOW, "submit", str(recipe), *overrides, "--nodes", "1", "--gpus", str(gpus)]
        + ["--dry-run", "--skip-pin-check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert dry.returncode == 2, dry.stderr
    assert f"error[{code}]: " in dry.stderr and "Traceback" not in dry.stderr
    assert not list(tmp_path.iterdir())
    with pytest.raises(RlflowError) as caught:  # train's setup path (rlflow.train.setup)
        check_allocation(load_checked(recipe, [*overrides, f"cluster.gpus_per_node={gpus}"]), gpus)
    assert code in [d.code for d in caught.value.diagnostics]


def test_the_expert_count_comes_from_the_checkpoint_config(tmp_path):
    """An HF directory's config.json (here a vision-language one: experts under text_config)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        json.dumps({"model_type": "qwen3_vl_moe", "text_config": {"num_experts": 6}})
    )
    base = [f"model.checkpoint={ckpt}", "parallelism.expert_parallel_size"]
    loaded = load_checked(VL_MOE, [f"{base[0]}", f"{base[1]}=2"])
    assert [d.code for d in allocation_diagnostics(loaded, 1, 2)] == []
    loaded = load_checked(VL_MOE, [f"{base[0]}", f"{base[1]}=4"])
    (problem,) = allocation_diagnostics(loaded, 1, 4)
    assert problem.code == "allocation.expert-parallel-experts"
    assert "does not divide the 6 experts" in problem.message
