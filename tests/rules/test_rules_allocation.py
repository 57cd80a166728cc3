"""Whatever `rlflow train` refuses at setup, `rlflow submit --dry-run` refuses first, with the
same code and message.

Train's check path, without a model: `load_checked` (rlflow.train.main) then `check_allocation`
(rlflow.train.setup, before any process group), on the recipe.yaml submit would write: the
recipe with `cluster` filled from --nodes/--gpus. The dry run is `prepare`, the function behind
`rlflow submit` (in-process for the generated cases; through the console script for a sample).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.errors import RlflowError
from rlflow.launch.plan import SubmitFlags
from rlflow.launch.prepare import prepare
from rlflow.rules import load_checked
from rlflow.rules.allocation import check_allocation

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = str(ROOT / ".venv" / "bin" / "rlflow")
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
QWEN_3B = ROOT / "recipes" / "vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml"
# What the trainer's setup path and the dry run both judge (the dry run judges more: sbatch
# values, paths, the script).
SHARED = ("recipe", "allocation", "data")


def train_refuses(recipe: Path, overrides: list[str], nodes: int, gpus: int) -> set[tuple]:
    """(code, message) of every error train's setup path raises for this job, before a model."""
    filled = [*overrides, f"cluster.num_nodes={nodes}", f"cluster.gpus_per_node={gpus}"]
    try:
        check_allocation(load_checked(recipe, filled), nodes * gpus)
    except RlflowError as err:
        return {(d.code, d.message) for d in err.diagnostics if d.severity == "error"}
    return set()


def dry_run_refuses(recipe: Path, overrides: list[str], nodes: int, gpus: int, cwd: Path):
    """(code, message, category) of every error the dry run reports (nothing is written)."""
    flags = SubmitFlags(nodes=nodes, gpus=gpus)
    try:
        prepared = prepare(recipe, tuple(overrides), flags, skip_pins=True, cwd=str(cwd))
    except RlflowError as err:
        problems = err.diagnostics
    else:
        problems = prepared.warnings
    return {(d.code, d.message, d.category) for d in problems if d.severity == "error"}


def assert_same_refusals(recipe: Path, overrides: list[str], nodes: int, gpus: int, cwd: Path):
    trained = train_refuses(recipe, overrides, nodes, gpus)
    dry = dry_run_refuses(recipe, overrides, nodes, gpus, cwd)
    assert {(code, message) for code, message, category in dry if category in SHARED} == trained
    return trained


@pytest.mark.parametrize("recipe", SHIPPED, ids=[p.name for p in SHIPPED])
@pytest.mark.parametrize("nodes, gpus", [(1, 1), (1, 2), (3, 8), (4, 8)])
def test_shipped_recipes_are_judged_alike(recipe, nodes, gpus, tmp_path):
    assert_same_refusals(recipe, [], nodes, gpus, tmp_path)


OVERRIDES = {
    "grpo.num_prompts_per_step": st.integers(1, 48),
    "grpo.num_generations_per_prompt": st.integers(1, 12),
    "grpo.num_minibatches": st.integers(0, 6),
    "warm_start.num_steps": st.sampled_from([0, 5]),
    "warm_start.batch_size": st.integers(1, 24),
    "parallelism.tensor_parallel_size": st.sampled_from([1, 2, 3, 4, 8]),
    "parallelism.pipeline_parallel_size": st.sampled_from([1, 1, 2]),
    "parallelism.context_parallel_size": st.sampled_from([1, 1, 2]),
    "parallelism.expert_parallel_size": st.sampled_from([1, 1, 2]),
    "data.train.kind": st.sampled_from(["clevr", "video", "text", "mixed", "jsonl"]),
    "data.video.num_frames": st.sampled_from(["null", "2", "3", "4"]),
    "data.video.temporal_patch_size": st.sampled_from(["null", "1", "2"]),
    "data.video.fps": st.sampled_from(["null", "2.0"]),
    "data.image_size": st.sampled_from([20, 28, 56, 112]),
    "data.max_objects": st.integers(0, 30),
    "rewards.format": st.sampled_from([0, 0.5, -1]),
    "rewards.exact_match": st.sampled_from([0, 1]),
}


@st.composite
def jobs(draw):
    recipe = draw(st.sampled_from(SHIPPED))
    keys = draw(st.lists(st.sampled_from(sorted(OVERRIDES)), unique=True, max_size=6))
    overrides = [f"{key}={draw(OVERRIDES[key])}" for key in keys]
    return recipe, overrides, draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 3, 4, 8]))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(job=jobs())
def test_generated_recipes_are_judged_alike(job, tmp_path):
    recipe, overrides, nodes, gpus = job
    assert_same_refusals(recipe, overrides, nodes, gpus, tmp_path)


def test_the_issue_example_fails_the_dry_run_with_trains_message(tmp_path):
    """3 x 8 GPUs at tensor parallel 2 is 12 data-parallel ranks: 10 prompts do not split."""
    overrides = ["grpo.num_prompts_per_step=10"]
    (refusal,) = assert_same_refusals(QWEN_3B, overrides, 3, 8, tmp_path)
    code, message = refusal
    assert code == "allocation.data-parallel"
    result = subprocess.run(
        [RLFLOW, "submit", str(QWEN_3B), "--nodes", "3", "--gpus", "8", *overrides, "--dry-run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert f"error[{code}]: {message}\n" in result.stderr
    assert "the data-parallel size 12 (3 nodes x 8 GPUs = 24 ranks over tensor 2" in message
    assert not list(tmp_path.iterdir())  # nothing written


CONSOLE_SAMPLE = [
    (TINY, ["grpo.num_prompts_per_step=3"], 1, 2),
    # 8 rollouts a step split into 4 updates, but each of 4 ranks has only 2
    (
        TINY,
        [
            "grpo.num_minibatches=4",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2",
        ],
        2,
        2,
    ),
    (TINY, ["warm_start.batch_size=3"], 1, 2),
    (TINY, ["parallelism.tensor_parallel_size=3"], 1, 4),
    (TINY, ["data.image_size=56", "data.max_objects=20"], 1, 1),
    (QWEN_3B, ["parallelism.pipeline_parallel_size=2"], 4, 8),
]


@pytest.mark.parametrize("recipe, overrides, nodes, gpus", CONSOLE_SAMPLE)
def test_the_console_script_reports_trains_refusals(recipe, overrides, nodes, gpus, tmp_path):
    refused = assert_same_refusals(recipe, overrides, nodes, gpus, tmp_path)
    assert refused, "each sample is one train refuses"
    result = subprocess.run(
        [RLFLOW, "submit", str(recipe), *overrides, "--nodes", str(nodes), "--gpus", str(gpus)]
        + ["--dry-run", "--skip-pin-check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    for code, message in refused:
        assert f"error[{code}]: {message}\n" in result.stderr


def test_train_refuses_at_setup_with_the_dry_runs_words(tmp_path):
    """The real trainer, as one of 2 ranks (WORLD_SIZE=2): refused by check_allocation before
    any process group or model, exit 2, the same diagnostic the dry run printed."""
    overrides = ["grpo.num_prompts_per_step=3"]
    (refusal,) = train_refuses(TINY, overrides, 1, 2)
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    result = subprocess.run(
        [RLFLOW, "train", str(TINY), *overrides, "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert f"error[{refusal[0]}]: {refusal[1]}\n" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_cluster_the_job_does_not_match_is_refused_by_train():
    loaded = load_checked(TINY, ["cluster.num_nodes=2", "cluster.gpus_per_node=4"])
    with pytest.raises(RlflowError) as caught:
        check_allocation(loaded, 4)
    (problem,) = caught.value.diagnostics
    assert problem.code == "allocation.cluster" and problem.category == "allocation"
    assert "says num_nodes 2 x gpus_per_node 4, but this job has 4 ranks" in problem.message
    check_allocation(loaded, 8)  # the shape it asserts
    check_allocation(load_checked(TINY, ["cluster.gpus_per_node=2"]), 8)  # 4 nodes of 2
