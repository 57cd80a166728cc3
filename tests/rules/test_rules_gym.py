"""`environment.kind: gym` on the login node: `submit --dry-run` shows the Gym servers rank 0
(or the generation ranks, with `generation.placement: separate`) will start and their ports
(read from Gym's config files, Gym not imported), and refuses what cannot work: the extra
missing, unknown servers, colliding ports, more tasks in flight than the server has rows or KV
cache, an engine one rank cannot serve alone, generation servers other nodes cannot reach."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.rules import load_checked

ROOT = Path(__file__).resolve().parents[2]
GYM = ROOT / "recipes" / "tiny-qwen3-gym-tool-1n1g-cpu.yaml"


def dry_run(
    *overrides: str,
    hide_gym: bool = False,
    nodes: int = 1,
    gpus: int = 1,
    recipe: Path = GYM,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """The console script's dry run on `nodes` of `gpus` (the test cluster's nodes have 4);
    hide_gym: as on a machine without the `gym` extra (the import system is told nemo_gym does
    not exist: uninstalling it would break the other tests of this environment)."""
    hide = "sys.modules['nemo_gym'] = None; " if hide_gym else ""
    code = f"import sys; {hide}from rlflow.cli import main; sys.argv[0] = 'rlflow'; main()"
    shape = ["--nodes", str(nodes), "--gpus", str(gpus), "--dry-run"]
    return subprocess.run(
        [sys.executable, "-c", code, "submit", str(recipe), *shape, *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


CIRCLES = "resources_servers/circle_count/configs/circle_count.yaml"


def test_the_dry_run_shows_the_gym_servers_and_their_ports():
    result = dry_run("generation.server.port=8123")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "rank 0 (first node) starts rlflow's server on 127.0.0.1:8123" in out
    assert "Gym's head server on 127.0.0.1:11000" in out
    for line in (
        "example_single_tool_call_simple_agent (responses_api_agents/simple_agent) on "
        "127.0.0.1:free",
        "example_single_tool_call (resources_servers/example_single_tool_call) on 127.0.0.1:free",
        "policy_model (responses_api_models/vllm_model) on 127.0.0.1:free",
        "every server answers within 120 s or the job ends; 8 tasks in flight, each at most "
        "120 s; a failed task: continue",
    ):
        assert line in out


def test_gym_on_generation_ranks_of_their_own_is_shown_and_must_be_reachable():
    """With generation.placement separate every generation rank serves Gym's turns and the
    first runs Gym; generation ranks on several nodes must listen beyond their own node."""
    separate = ["generation.placement=separate", "async_grpo.max_staleness=1"]
    one_node = dry_run(*separate, "generation.gpus_per_node=2", gpus=4)
    assert one_node.returncode == 0, one_node.stderr
    assert (
        "every generation rank starts rlflow's server on 127.0.0.1:free; the first generation "
        "rank (its node) starts Gym's head server on 127.0.0.1:11000, and:" in one_node.stdout
    )
    two_nodes = [*separate, "generation.num_nodes=2"]
    refused = dry_run(*two_nodes, nodes=3)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (
        "sends turns to the servers of all 2 generation ranks on 2 nodes, but they listen on "
        "127.0.0.1 (this node only)" in refused.stderr
    )
    assert "set generation.server.host=0.0.0.0" in refused.stderr
    assert "Traceback" not in refused.stderr
    ok = dry_run(*two_nodes, "generation.server.host=0.0.0.0", nodes=3)
    assert ok.returncode == 0, ok.stderr
    engines = dry_run(*separate, "generation.gpus_per_node=2", "generation.tensor_parallel_size=2",
                      gpus=4)  # fmt: skip
    assert engines.returncode == 0, engines.stderr
    assert (
        "the first rank of every generation engine (tensor-parallel size 2: the others follow "
        "its plans) starts rlflow's server" in engines.stdout
    )


def test_the_founding_shape_can_train_in_gym_with_its_tp4_engines():
    """The founding recipe (16 nodes: 8 train at TP 4 x EP 4, 8 generate at TP 4) in Gym's
    VLM environment: 16 engines serve, each from its first rank, reachable from other nodes."""
    founding = (
        ROOT / "recipes" / "vlm_grpo-nemotron-omni-30ba3b-16n8g-megatron-tp4ep4-async-video.yaml"
    )
    gym = [
        "environment.kind=gym", f"environment.gym.config_paths=[{CIRCLES}]",
        "environment.gym.agent=circle_count_simple_agent", "environment.gym.tasks=example",
    ]  # fmt: skip
    # as on a login node of a cluster that shape (the suite's own Slurm cluster has 4-GPU nodes)
    no_cluster = {**os.environ, "SLURM_CONF": "/nonexistent"}
    result = dry_run(*gym, "generation.server.host=0.0.0.0", nodes=16, gpus=8, recipe=founding,
                     env=no_cluster)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        "the first rank of every generation engine (tensor-parallel size 4: the others follow "
        "its plans) starts rlflow's server on 0.0.0.0:8000 + its local rank" in result.stdout
    )


def test_the_dry_run_refuses_gym_without_the_extra():
    result = dry_run(hide_gym=True)
    assert result.returncode != 0
    assert "NeMo Gym (nemo_gym) is not installed" in result.stderr
    assert "uv sync --extra gym" in result.stderr and "Traceback" not in result.stderr


def problems(*overrides: str) -> str:
    with pytest.raises(RlflowError) as caught:
        load_checked(GYM, list(overrides))
    return "\n".join(d.render() for d in caught.value.diagnostics)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["generation.server.port=11000"],
         ["port 11000 is used twice", "generation.server.port", "environment.gym.head_port"]),
        (["environment.gym.concurrency=9"],
         ["`environment.gym.concurrency` (9) is above generation.server.max_rows (8)"]),
        (["generation.kv_cache_tokens=4096"],
         ["generation.kv_cache_tokens 4096 < 8 x generation.server.context_tokens 2048"]),
        (["environment.gym.agent=no_such_agent"],
         ["['no_such_agent'] are not defined by environment.gym.config_paths"]),
        (["environment.gym.config_paths=[missing.yaml]"],
         ["cannot be read", "missing.yaml"]),
        (["parallelism.tensor_parallel_size=2", "parallelism.expert_parallel_size=2"],
         ["from rank 0's megatron engine on its whole model; not implemented with "
          "parallelism.tensor_parallel_size=2, parallelism.expert_parallel_size=2",
          "or generation.placement=separate"]),
        (["generation.placement=separate", "generation.backend=vllm"],
         ["from the generation ranks' megatron engines; not implemented with "
          "generation.backend=vllm", "use generation.backend=megatron"]),
    ],
    ids=["ports", "rows", "kv-cache", "agent", "config", "engine", "separate-engine"],
)  # fmt: skip
def test_what_cannot_work_is_refused_naming_the_key(overrides, words):
    text = problems(*overrides)
    assert all(w in text for w in words), text
