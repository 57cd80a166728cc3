"""generation.placement: which ranks train and which generate, and the rules on the split.

Every refusal is checked on both paths, as tests/rules/test_rules_allocation.py does: train's
setup check (`check_allocation`) and the dry run (`prepare`) report the same code and message.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.errors import RlflowError
from rlflow.launch.plan import SubmitFlags
from rlflow.launch.prepare import prepare
from rlflow.recipe.placement import Placement
from rlflow.rules import load_checked
from rlflow.rules.allocation import check_allocation, placement_of

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = str(ROOT / ".venv" / "bin" / "rlflow")
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
SEPARATE = ["generation.placement=separate"]


def refusals(overrides: list[str], nodes: int, gpus: int, cwd: Path) -> set[tuple[str, str]]:
    """(code, message) of what train refuses at setup, asserted equal to the dry run's."""
    filled = [*overrides, f"cluster.num_nodes={nodes}", f"cluster.gpus_per_node={gpus}"]
    try:
        check_allocation(load_checked(TINY, filled), nodes * gpus)
        trained = set()
    except RlflowError as err:
        trained = {(d.code, d.message) for d in err.diagnostics}
    try:
        prepared = prepare(TINY, tuple(overrides), SubmitFlags(nodes=nodes, gpus=gpus),
                           skip_pins=True, cwd=str(cwd))  # fmt: skip
        problems = prepared.warnings
    except RlflowError as err:
        problems = err.diagnostics
    dry = {
        (d.code, d.message)
        for d in problems
        if d.severity == "error" and d.category in ("recipe", "allocation", "data")
    }
    assert dry == trained
    return trained


def test_gpus_per_node_takes_the_last_ranks_of_every_node():
    recipe = load_checked(TINY, [*SEPARATE, "generation.gpus_per_node=1"]).recipe
    placement = placement_of(recipe, nodes=2, gpus=4)
    assert placement == Placement(training=(0, 1, 2, 4, 5, 6), generation=(3, 7))
    assert placement.role(0) == "train" and placement.role(7) == "generate"
    assert placement.describe() == "ranks 0-2, 4-6 train, ranks 3, 7 generate"


def test_num_nodes_takes_the_last_nodes():
    recipe = load_checked(TINY, [*SEPARATE, "generation.num_nodes=1"]).recipe
    placement = placement_of(recipe, nodes=3, gpus=2)
    assert placement == Placement(training=(0, 1, 2, 3), generation=(4, 5))
    assert placement.describe() == "ranks 0-3 train, ranks 4-5 generate"


def test_colocated_is_every_rank_training():
    placement = placement_of(load_checked(TINY, []).recipe, nodes=1, gpus=2)
    assert not placement.separate and placement.training == (0, 1)
    assert placement.describe() == "ranks 0-1 train and generate (placement colocated)"


def test_a_valid_split_is_accepted(tmp_path):
    overrides = [*SEPARATE, "generation.gpus_per_node=1", "async_grpo.max_staleness=1"]
    assert refusals(overrides, 1, 3, tmp_path) == set()  # 2 trainers (data parallel 2) + 1


REFUSED = [
    # (overrides, nodes, gpus, key named in the message)
    (["generation.gpus_per_node=1"], 1, 3, "`generation.gpus_per_node` is set"),
    (["async_grpo.max_staleness=1"], 1, 2, "`async_grpo.max_staleness` is set"),
    (SEPARATE, 1, 2, "set exactly one of them above 0"),
    ([*SEPARATE, "generation.gpus_per_node=1", "generation.num_nodes=1"], 2, 2, "exactly one"),
    ([*SEPARATE, "generation.gpus_per_node=2"], 1, 2, "leaves no training rank"),
    ([*SEPARATE, "generation.num_nodes=2"], 2, 1, "leaves no training node"),
    ([*SEPARATE, "generation.gpus_per_node=1", "generation.backend=hf"], 1, 2, "backend hf"),
    (
        [*SEPARATE, "generation.gpus_per_node=3", "generation.tensor_parallel_size=2"],
        1,
        4,
        "does not divide the 3 generation ranks of a node",
    ),
    (
        [*SEPARATE, "generation.gpus_per_node=3", "grpo.num_prompts_per_step=16"],
        1,
        4,
        "not a multiple of the 3 generation replicas",
    ),
    (
        [*SEPARATE, "generation.gpus_per_node=2", "parallelism.expert_parallel_size=2"],
        1,
        4,
        "expert_parallel_size",  # the dense tiny model: the expert rule refuses it first
    ),
    ([*SEPARATE, "generation.gpus_per_node=1", "async_grpo.max_staleness=-1"], 1, 2, "staleness"),
]


@pytest.mark.parametrize("overrides, nodes, gpus, said", REFUSED)
def test_refused_splits_name_the_key(overrides, nodes, gpus, said, tmp_path):
    refused = refusals(overrides, nodes, gpus, tmp_path)
    assert any(said in message for _, message in refused), refused


def test_the_training_ranks_alone_carry_the_data_parallel_rules(tmp_path):
    """1 node x 3: 2 trainers; 3 prompts split over 3 ranks, not over 2."""
    overrides = [*SEPARATE, "generation.gpus_per_node=1", "grpo.num_prompts_per_step=3"]
    ((code, message),) = refusals(overrides, 1, 3, tmp_path)
    assert code == "allocation.data-parallel"
    assert "the data-parallel size 2 (the 2 training ranks of 1 node x 3 GPUs" in message


PLACEMENT_OVERRIDES = {
    "generation.placement": st.sampled_from(["colocated", "separate", "separate"]),
    "generation.gpus_per_node": st.integers(0, 4),
    "generation.num_nodes": st.integers(0, 3),
    "generation.tensor_parallel_size": st.sampled_from([1, 1, 2, 3]),
    "async_grpo.max_staleness": st.integers(0, 3),
    "grpo.num_prompts_per_step": st.sampled_from([4, 6, 12, 16]),
    "parallelism.tensor_parallel_size": st.sampled_from([1, 2]),
}


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    picked=st.lists(st.sampled_from(sorted(PLACEMENT_OVERRIDES)), unique=True, max_size=5),
    data=st.data(),
    nodes=st.integers(1, 3),
    gpus=st.sampled_from([1, 2, 3, 4]),
)
def test_generated_splits_are_judged_alike(picked, data, nodes, gpus, tmp_path):
    overrides = [f"{key}={data.draw(PLACEMENT_OVERRIDES[key])}" for key in picked]
    refusals(overrides, nodes, gpus, tmp_path)


def test_the_dry_run_shows_and_the_script_logs_which_ranks_do_what(tmp_path):
    overrides = [*SEPARATE, "generation.gpus_per_node=1", "async_grpo.max_staleness=1"]
    result = subprocess.run(
        [RLFLOW, "submit", str(TINY), *overrides, "--nodes", "2", "--gpus", "3", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    line = "ranks 0-1, 3-4 train, ranks 2, 5 generate"
    assert f"placement:  {line}\n" in result.stdout
    assert f"log 'placement: {line} (generation.placement separate)'\n" in result.stdout
