"""The expert-parallel and router-replay rules (rlflow/rules/allocation.py): the dry run and
train's setup refuse the same recipes, with the same code; an MoE recipe with EP > 1 passes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.rules import load_checked
from rlflow.rules.allocation import allocation_diagnostics, check_allocation
from tests.slurm.jobs import assert_printed

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
    assert codes(MOE, [*tp_ep, "parallelism.sequence_parallel=off"], 4) == []


@pytest.mark.parametrize(
    "recipe, overrides, gpus, code",
    [
        (DENSE, ["parallelism.expert_parallel_size=2"], 2, "allocation.expert-parallel-dense"),
        (MOE, ["parallelism.expert_parallel_size=3"], 3, "allocation.expert-parallel-experts"),
        (VL_MOE, ["parallelism.expert_parallel_size=8"], 8, "allocation.expert-parallel-experts"),
        (MOE, ["generation.backend=hf"], 1, "allocation.router-replay-backend"),
        (MOE, ["parallelism.expert_parallel_size=2"], 3, "allocation.parallel-sizes"),
        # sequence parallelism (auto: on at TP > 1) is not implemented for MoE models
        (MOE, ["parallelism.tensor_parallel_size=2"], 2, "allocation.moe-sequence-parallel"),
        (
            VL_MOE,
            ["parallelism.tensor_parallel_size=2", "parallelism.sequence_parallel=on"],
            2,
            "allocation.moe-sequence-parallel",
        ),
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


RECIPE_30B = ROOT / "recipes" / "vlm_grpo-qwen3vl-30ba3b-clevr-4n8g-megatron-tp2ep8.yaml"
# Qwen3-VL-30B-A3B-Instruct's config.json, the numbers the allocation rules and families read
QWEN3VL_30B_A3B = {
    "model_type": "qwen3_vl_moe",
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "text_config": {
        "model_type": "qwen3_vl_moe_text",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": 151936,
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "deepstack_visual_indexes": [8, 16, 24],
    },
}


def test_the_30b_a3b_recipe_passes_the_dry_run_at_4_nodes_x_8_gpus(tmp_path):
    """The shipped 30B-A3B recipe, pointed at a checkpoint directory with the real config.json
    (128 experts): `rlflow submit --dry-run` through the console script passes and shows the
    TP x EP layout; the same job at EP 6 (not a divisor of 128) is refused."""
    ckpt = tmp_path / "Qwen3-VL-30B-A3B-Instruct"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(QWEN3VL_30B_A3B))
    work = tmp_path / "work"
    work.mkdir()

    def dry_run(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [RLFLOW, "submit", str(RECIPE_30B), "--nodes", "4", "--gpus", "8"]
            + [f"model.checkpoint={ckpt}", *overrides, "--dry-run", "--skip-pin-check"],
            capture_output=True,
            text=True,
            cwd=work,
            timeout=120,
            # no Slurm controller: the session's test cluster (4 GPUs a node) must not be asked
            # whether an 8-GPU node exists
            env={**os.environ, "SLURM_CONF": "/nonexistent"},
        )

    ok = dry_run()
    assert_printed(
        ok,
        "4 nodes x 8 GPUs = 32 ranks",
        "experts:    128 per layer over expert parallel 8 (16 per rank, each split over tensor "
        "parallel 2); tensor 2 x data 16",
    )
    assert "error" not in ok.stderr
    refused = dry_run("parallelism.expert_parallel_size=6")
    assert refused.returncode == 2
    assert "does not divide the 128 experts" in refused.stderr  # (and 6 x 2 does not divide 32)
    assert not list(work.iterdir())


RECIPE_OMNI = (
    ROOT / "recipes" / "vlm_grpo-nemotron-omni-30ba3b-16n8g-megatron-tp4ep4-async-video.yaml"
)


def _omni_30b_a3b_config(ckpt) -> None:
    """config.json of the `nemotron-omni-30b-a3b` preset (the language model's pattern under
    `llm_config`, as the real checkpoint's) and the processor's one-frame temporal patch."""
    from transformers import RadioConfig

    from rlflow.model.families.nemotron_h import hf_config
    from rlflow.model.families.nemotron_omni import MODEL_TYPE, PRESETS, hf

    s = PRESETS["nemotron-omni-30b-a3b"]
    vision = RadioConfig(
        hidden_size=s.vision_hidden, num_hidden_layers=s.vision_layers,
        num_attention_heads=s.vision_heads, patch_size=16, max_img_size=s.vision_max_img_size,
        num_cls_tokens=s.vision_cls_tokens, num_registers=s.vision_registers,
    )  # fmt: skip
    config = hf.NemotronOmniConfig(
        llm_config=hf_config(s), vision_config=vision, projector_hidden_size=s.projector_hidden,
        img_context_token_id=18, video_context_token_id=19, tie_word_embeddings=False,
    ).to_dict()  # fmt: skip
    config["architectures"] = [MODEL_TYPE]
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    processor = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 1}
    (ckpt / "preprocessor_config.json").write_text(json.dumps(processor))


def test_the_nemotron_omni_30b_a3b_recipe_passes_the_dry_run_at_16_nodes_x_8_gpus(tmp_path):
    """The founding recipe (TP 4 over 2 KV heads, EP 4, generation on separate nodes, video),
    pointed at the preset's config.json: the dry run passes through the console script and
    shows the split; at 8 nodes, where its 8 generation nodes leave none to train, it is refused
    and nothing is written."""
    ckpt = tmp_path / "Nemotron-Omni-30B-A3B"
    _omni_30b_a3b_config(ckpt)
    work = tmp_path / "work"
    work.mkdir()

    def dry_run(nodes: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [RLFLOW, "submit", str(RECIPE_OMNI), "--nodes", nodes, "--gpus", "8"]
            + [f"model.checkpoint={ckpt}", "--dry-run", "--skip-pin-check"],
            capture_output=True, text=True, cwd=work, timeout=120,
            env={**os.environ, "SLURM_CONF": "/nonexistent"},
        )  # fmt: skip

    ok = dry_run("16")
    assert_printed(
        ok,
        "16 nodes x 8 GPUs = 128 ranks",
        "placement:  ranks 0-63 train, ranks 64-127 generate",
        "experts:    128 per layer over expert parallel 4 (32 per rank, each split over tensor "
        "parallel 4); tensor 4 x data 32",
    )
    assert "error" not in ok.stderr
    refused = dry_run("8")
    assert refused.returncode == 2, refused.stderr
    assert "error[allocation.placement]" in refused.stderr
    assert "leaves no training node" in refused.stderr
    assert not list(work.iterdir())
