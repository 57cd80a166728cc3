"""Settings checked against the model and the backend before the job starts (issue 36, item 5).

Each case passed `rlflow submit --dry-run` before (then failed on every rank, or was ignored):
through the console script it now exits 2 with the key, the reason and the fix, and nothing is
written. The model's sizes come from the builtin's family or the checkpoint's config.json
(rlflow.model.shape), read without torch.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = str(ROOT / ".venv" / "bin" / "rlflow")
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
MOE = ROOT / "recipes" / "tiny-qwen3-moe-text-1n1g-cpu.yaml"
QWEN_3B = ROOT / "recipes" / "vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml"
# Qwen2.5-VL-3B-Instruct's config.json, the keys the rules read (16 heads, 2 KV heads, dense)
QWEN_3B_CONFIG = {
    "model_type": "qwen2_5_vl",
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "num_hidden_layers": 36,
    "max_position_embeddings": 128000,
    "vision_config": {"depth": 32, "num_heads": 16},
}


def dry_run(cwd: Path, recipe: Path, *args: str, nodes: int = 1, gpus: int = 1):
    flags = ["--nodes", str(nodes), "--gpus", str(gpus)]
    result = subprocess.run(
        [RLFLOW, "submit", str(recipe), *args, "--dry-run", *flags],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in result.stderr
    assert not list(cwd.iterdir())  # nothing written
    return result


@pytest.mark.parametrize(
    "recipe, overrides, error",
    [
        (TINY, ["model.moe.router_topk=1"],
         "error[recipe.does-nothing]: `model.moe.router_topk` is set, but does nothing: "
         "`model.checkpoint` (builtin:tiny-qwen25vl) is a dense model"),
        (TINY, ["parallelism.tensor_parallel_size=3"],
         "error[recipe.tensor-parallel-heads]: `parallelism.tensor_parallel_size` (3) does not "
         "divide the 4 attention heads and 2 KV heads of `model.checkpoint` "
         "(builtin:tiny-qwen25vl)"),
        (TINY, ["generation.max_new_tokens=1000000000"],
         "error[recipe.range]: `generation.max_new_tokens` must be in [1, 1048576] "
         "(it is 1000000000)"),
        (TINY, ["generation.max_new_tokens=4000"],
         "error[recipe.context-length]: `data.max_prompt_tokens` (512) + "
         "`generation.max_new_tokens` (4000) is more than the 4096 positions of "
         "`model.checkpoint` (builtin:tiny-qwen25vl, max_position_embeddings)"),
        (TINY, ["slurm.request_gpus=true", "generation.kv_cache_tokens=1000000000"],
         "error[recipe.kv-cache-size]: `generation.kv_cache_tokens` (1000000000) makes a KV "
         "cache of 1,907 GiB per rank"),
        (TINY, ["generation.kv_cache_tokens=256"],
         "error[recipe.kv-cache-size]: `generation.kv_cache_tokens` (256) cannot hold one row "
         "of 520 tokens"),
        (MOE, ["model.moe.router_topk=0"],
         "error[recipe.range]: `model.moe.router_topk` must be at least 1 (it is 0)"),
        (MOE, ["model.moe.router_topk=9"],
         "error[recipe.moe-router-topk]: `model.moe.router_topk` is 9, but `model.checkpoint` "
         "(builtin:tiny-qwen3-moe) has 8 experts"),
        (MOE, ["model.moe.aux_loss_coeff=-1"],
         "error[recipe.range]: `model.moe.aux_loss_coeff` must not be negative (it is -1)"),
        (MOE, ["model.moe.z_loss_coeff=-1"],
         "error[recipe.range]: `model.moe.z_loss_coeff` must not be negative (it is -1)"),
        (TINY, ["generation.backend=hf", "generation.release_cache=false"],
         "error[recipe.does-nothing]: `generation.release_cache` is set, but does nothing: "
         "`generation.backend` is hf; only the megatron backend reads it"),
        (TINY, ["loss.router_replay=false"],
         "error[recipe.does-nothing]: `loss.router_replay` is set, but does nothing"),
        (MOE, ["model.freeze_vision=false"],
         "error[recipe.does-nothing]: `model.freeze_vision` is set, but does nothing: "
         "`model.checkpoint` (builtin:tiny-qwen3-moe) is a text-only model (no vision tower)"),
        (TINY, ["warm_start.num_steps=0", "warm_start.lr=0.001"],
         "error[recipe.does-nothing]: `warm_start.lr` is set, but does nothing: "
         "`warm_start.num_steps` is 0"),
        (TINY, ["data.train.num_samples=1000000000000"],
         "error[recipe.range]: `data.train.num_samples` (1000000000000) is more than 10,000,000 "
         "synthetic rows"),
        (TINY, ["optimizer.adam_beta2=-1"],
         "error[recipe.range]: `optimizer.adam_beta2` must be in [0, 1) (it is -1)"),
    ],
)  # fmt: skip
def test_the_dry_run_refuses_what_the_model_or_backend_cannot_do(
    tmp_path, recipe, overrides, error
):
    result = dry_run(tmp_path, recipe, *overrides)
    assert result.returncode == 2, result.stdout + result.stderr
    assert error in result.stderr
    assert "help: " in result.stderr


def test_sizes_come_from_the_checkpoints_config_json(tmp_path):
    """A real checkpoint's config.json (here Qwen2.5-VL-3B's sizes): TP must divide its 2 KV
    heads, EP needs experts, its context bounds the generation."""
    checkpoint = tmp_path / "Qwen2.5-VL-3B-Instruct"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(QWEN_3B_CONFIG))
    work = tmp_path / "work"
    work.mkdir()
    run = dict(nodes=8, gpus=4)  # the test cluster's nodes have 4 GPUs (when it is up)
    at = f"model.checkpoint={checkpoint}"
    ok = dry_run(work, QWEN_3B, at, **run)
    assert ok.returncode == 0, ok.stderr
    tp4 = dry_run(work, QWEN_3B, at, "parallelism.tensor_parallel_size=4", **run)
    assert tp4.returncode == 2
    assert "does not divide the 2 KV heads of `model.checkpoint`" in tp4.stderr
    assert "choose one of 1, 2" in tp4.stderr
    ep2 = dry_run(work, QWEN_3B, at, "parallelism.expert_parallel_size=2", **run)
    assert ep2.returncode == 2
    assert "error[allocation.expert-parallel-dense]" in ep2.stderr


def test_a_key_turned_off_later_is_not_refused(tmp_path):
    """What switches a key off, set after it (a command-line override of a recipe's setting),
    says what the user means: `warm_start.num_steps=0` after `warm_start.batch_size=8`."""
    later = dry_run(tmp_path, TINY, "warm_start.batch_size=8", "warm_start.num_steps=0")
    assert later.returncode == 0, later.stderr


def test_train_refuses_with_the_dry_runs_words(tmp_path):
    """`rlflow train` runs the same rules before any process group or model: exit 2, the line
    the dry run prints, no traceback on any rank."""
    overrides = ["parallelism.tensor_parallel_size=3", "model.moe.router_topk=2"]
    dry = dry_run(tmp_path, TINY, *overrides)
    result = subprocess.run(
        [RLFLOW, "train", str(TINY), *overrides, "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in dry.stderr.splitlines() if line.startswith("error[")]
    assert len(errors) == 2 and all(line in result.stderr for line in errors)


def test_the_runs_resolved_recipe_passes_where_the_dry_run_passed(tmp_path):
    """The nodes load the run's recipe.yaml (every key in one file, no defaults chain): what
    the dry run accepted, a key switched off later included, `rlflow train` accepts there."""
    from rlflow.recipe.load import dump_recipe
    from rlflow.rules import load_checked

    overrides = ["checkpointing.save_period=5", "checkpointing.enabled=false"]
    resolved = tmp_path / "recipe.yaml"
    resolved.write_text(dump_recipe(load_checked(TINY, overrides).data))
    assert load_checked(resolved).recipe.checkpointing.save_period == 5


# Nemotron-3-Nano-30B-A3B's shapes (the dense cut: the engine rule says nothing about MoE
# layers here): 32 heads over 2 KV heads, Mamba-2 mixers of 64 heads in 8 B/C groups
NEMOTRON_H_30B = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "hidden_size": 2688,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 262144,
    "hybrid_override_pattern": "M-M-M*-M-M-M*-M-M-M*-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M-",
    "mamba_num_heads": 64,
    "n_groups": 8,
}


def test_a_hybrid_may_share_kv_heads_but_not_split_mamba_groups(tmp_path):
    """A hybrid's TP may exceed its KV heads (a multiple of them: megatron-core and the engine's
    hybrid decoder give each rank one KV head, shared); it must divide the Mamba mixer's heads
    and groups (megatron-core's MambaMixer asserts it on every rank). A GPT model may not share
    (test_sizes_come_from_the_checkpoints_config_json: Qwen2.5-VL-3B at TP 4)."""
    checkpoint = tmp_path / "Nemotron-H-30B-A3B"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(NEMOTRON_H_30B))
    work = tmp_path / "work"
    work.mkdir()
    recipe = ROOT / "recipes" / "tiny-nemotron-h-text-1n1g-cpu.yaml"
    at = [f"model.checkpoint={checkpoint}", "parallelism.sequence_parallel=off"]
    run = dict(nodes=4, gpus=4)  # the test cluster's nodes have 4 GPUs (when it is up)
    for tp in (4, 8):
        ok = dry_run(work, recipe, *at, f"parallelism.tensor_parallel_size={tp}", **run)
        assert ok.returncode == 0, ok.stderr
    refused = dry_run(work, recipe, *at, "parallelism.tensor_parallel_size=16", **run)
    assert refused.returncode == 2
    assert (
        "error[recipe.tensor-parallel-heads]: `parallelism.tensor_parallel_size` (16) does not "
        "divide the 8 Mamba B/C groups" in refused.stderr
    )
    assert "choose one of 1, 2, 4, 8" in refused.stderr
