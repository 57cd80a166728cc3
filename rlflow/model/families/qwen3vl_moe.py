"""Qwen3-VL-MoE (30B-A3B, 235B-A22B): Qwen3-VL whose every decoder MLP is a routed MoE layer.

Everything but the MLP is Qwen3-VL's (rlflow/model/families/qwen3vl/__init__.py: tower, DeepStack, interleaved
mrope, the bridge registration and which path runs where). The language model's MoE layers are
megatron-core's router and token dispatcher with rlflow's grouped experts and routing hook
(rlflow/model/moe/experts.py, the same as Qwen3-MoE text: `model.moe` keys, router replay, expert
parallelism); HF stores the experts fused (`experts.gate_up_proj`, `experts.down_proj`) and
megatron-bridge's mappings split them per expert.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.model.families.qwen3vl import Qwen3VL, write_tiny_qwen3vl
from rlflow.model.moe import MixtureOfExperts


class Qwen3VLMoe(MixtureOfExperts, Qwen3VL):
    model_types = ("qwen3_vl_moe",)
    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    builtins = ("tiny-qwen3vl-moe",)

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        return write_tiny_qwen3vl(out_dir, seed=seed, lm_head_scale=lm_head_scale, moe=True)

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.families.qwen3vl import MOE_EXPERTS

        return {**super().builtin_config(name), **MOE_EXPERTS}


FAMILY = Qwen3VLMoe()
