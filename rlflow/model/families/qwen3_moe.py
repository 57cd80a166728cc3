"""Text-only Qwen3-MoE: Qwen3's decoder (per-head q/k RMSNorm, 1-D RoPE) whose MLP is a routed
mixture of experts in every layer (softmax router, top-k, `norm_topk_prob` renormalisation).

Which path runs where: megatron-bridge 0.6.2 converts the checkpoint (its `Qwen3MoEBridge`,
weights on disk one tensor per expert), and rlflow builds the model with megatron-core's local
layer spec on every machine (no Transformer Engine, same numerics on CPU and GPU), its experts as
rlflow's grouped module and its MoE settings from the recipe's `moe` section
(rlflow/model/moe/experts.py). HF transformers 5 holds the experts fused in memory (`gate_up_proj`
[E, 2F, H], `down_proj` [E, H, F]); `hf_state_dict` stacks the bridge's per-expert export into
that layout for the HF backend.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rlflow.model.families.qwen_text import QwenText
from rlflow.model.moe import MixtureOfExperts
from rlflow.model.tiny import LanguageSizes

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class Qwen3Moe(MixtureOfExperts, QwenText):
    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    builtins = ("tiny-qwen3-moe",)

    def hf_state_dict(self, exported: dict) -> dict:
        """On-disk (per-expert) names -> HF's in-memory fused expert tensors."""
        import torch

        out, experts = {}, {}
        for name, tensor in exported.items():
            match = _EXPERT.match(name)
            if match is None:
                out[name] = tensor
                continue
            prefix, index, kind = match.group(1), int(match.group(2)), match.group(3)
            experts.setdefault(prefix, {}).setdefault(kind, {})[index] = tensor
        for prefix, kinds in experts.items():
            order = sorted(kinds["gate"])
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat((kinds["gate"][e], kinds["up"][e])) for e in order]
            )
            out[f"{prefix}.down_proj"] = torch.stack([kinds["down"][e] for e in order])
        return out

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        return write_tiny_qwen3_moe(out_dir, seed=seed, lm_head_scale=lm_head_scale)

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.shape import builtin_keys

        sizes = PRESETS["tiny"]
        return builtin_keys(
            sizes,
            max_positions=sizes.max_positions,
            experts=sizes.experts,
            topk=sizes.topk,
            multimodal=False,
        )


FAMILY = Qwen3Moe()


@dataclass(frozen=True)
class MoESizes(LanguageSizes):
    """Shapes of a random Qwen3-MoE (the tokenizer stays the tiny one: vocab_size may exceed it,
    as real checkpoints pad their embedding; `intermediate` is unused: every layer is MoE)."""

    vocab_size: int = 0  # 0: the tokenizer's size
    layers: int = 2
    head_dim: int = 32
    experts: int = 8
    topk: int = 2
    expert_intermediate: int = 64


# A preset: the language model's shapes, then the experts', a few to a line.
# fmt: off
PRESETS = {
    "tiny": MoESizes(),
    # Qwen3-30B-A3B's shapes (48 layers: 30.5 B parameters, 3.3 B active); benchmarks cut depth
    "qwen3-30b-a3b": MoESizes(
        vocab_size=151936, hidden=2048, heads=32, kv_heads=4, head_dim=128, layers=48,
        experts=128, topk=8, expert_intermediate=768, rope_theta=1000000.0, max_positions=40960,
    ),
}
# fmt: on


def write_tiny_qwen3_moe(
    out_dir: str | Path,
    *,
    seed: int,
    lm_head_scale: float = 1.0,
    sizes: MoESizes = PRESETS["tiny"],
    device: str = "cpu",
) -> Path:
    """A random Qwen3-MoE checkpoint (the builtin: 8 experts, top-2, 2 layers) with the same
    locally built tokenizer and chat template as the other tiny models; bf16 when built on a GPU
    (a 30B-A3B-shaped model initialises in seconds there)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlflow.model.tiny import TinyModel, token_ids_config, write_tiny

    def config(ids: dict[str, int], tokens: int):
        return Qwen3MoeConfig(
            vocab_size=sizes.vocab_size or tokens,
            hidden_size=sizes.hidden,
            intermediate_size=4 * sizes.hidden,  # unused: every layer is MoE
            moe_intermediate_size=sizes.expert_intermediate,
            num_experts=sizes.experts,
            num_experts_per_tok=sizes.topk,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            router_aux_loss_coef=0.001,
            num_hidden_layers=sizes.layers,
            num_attention_heads=sizes.heads,
            num_key_value_heads=sizes.kv_heads,
            head_dim=sizes.head_dim,
            max_position_embeddings=sizes.max_positions,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": sizes.rope_theta},
            tie_word_embeddings=False,
            **token_ids_config(ids),
        )

    def router(model) -> None:
        # HF initialises the router with std 0.02: near-equal scores, choices decided by
        # rounding. A wider random router makes every token's top-k clear.
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)

    tiny = TinyModel(Qwen3MoeForCausalLM, config, bos=False, init=router)
    return write_tiny(out_dir, tiny, sizes, seed=seed, device=device, lm_head_scale=lm_head_scale)
