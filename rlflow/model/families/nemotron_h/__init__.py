"""Nemotron-H text: a hybrid of Mamba-2 mixers, attention and MLP layers (megatron-core's
HybridModel), the language model of Nemotron Omni.

The layer pattern (HF `hybrid_override_pattern`, e.g. `M-M*-`) says each layer's kind: `M` a
Mamba-2 mixer, `*` attention (no positional encoding: the Mamba layers carry order), `-` a
squared-ReLU MLP, `E` a mixture of experts (refused: not built yet). Every layer is pre-norm
(RMSNorm) with a residual.

Which path runs where: rlflow's bridge registration (model.py) keeps megatron-bridge's
`NemotronHBridge` mappings and provider with a local (non-TE) stack spec, on every machine; the
Mamba mixer runs `mamba-ssm`'s CUDA kernels where installed, else rlflow's PyTorch reference
(docs/hybrid-kernels.md). Text only, right-padded rows (a Mamba layer reads every token before
it: left padding would enter the state).

Limits: one model-parallel rank (TP, CP, PP and EP refused). Both generation backends run it:
the Megatron engine holds the Mamba layers' conv and SSM states per row
(rlflow/generation/megatron/hybrid_decoder.py, docs/hybrid-kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlflow.model.family import ModelFamily
from rlflow.model.presets import NEMOTRON_H_PRESET_NAMES
from rlflow.model.tiny import LanguageSizes


class NemotronH(ModelFamily):
    model_types = ("nemotron_h",)
    architectures = ("NemotronHForCausalLM",)
    builtins = ("tiny-nemotron-h",)
    multimodal = False
    rope = "1d"  # descriptive: attention has no rotary; positions are unused

    def register_bridge(self) -> None:
        from rlflow.model.families.nemotron_h import model

        model.register()

    def configure_provider(self, provider, hf_config, model_cfg) -> None:
        from rlflow.model.families.nemotron_h import model

        model.check_parallelism(provider)

    def install(self, core) -> None:
        from rlflow.model.families.nemotron_h import model

        model.install(core)

    def hf_module_name(self, exported: str) -> str:
        """On disk `backbone.*` (the checkpoint's names); in transformers 5's memory `model.*`."""
        if exported.startswith("backbone."):
            return "model." + exported[len("backbone.") :]
        return exported

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        return write_tiny_nemotron_h(out_dir, seed=seed, lm_head_scale=lm_head_scale)

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.shape import builtin_keys

        sizes = PRESETS["tiny-nemotron-h"]
        keys = builtin_keys(sizes, max_positions=sizes.max_positions, multimodal=False)
        return {**keys, "hybrid_override_pattern": sizes.pattern}


FAMILY = NemotronH()


@dataclass(frozen=True)
class HybridSizes(LanguageSizes):
    """Shapes of a random Nemotron-H: the language model's, the layer pattern, the Mamba mixer's
    (heads x head_dim channels, groups of B/C, state size, the scan's chunk)."""

    pattern: str = "M-*M-"
    head_dim: int = 32
    mamba_heads: int = 8
    mamba_head_dim: int = 32
    mamba_groups: int = 2
    state: int = 16
    chunk: int = 16
    experts: int = 0  # `E` layers (refused by the loader until built)
    topk: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0


# A preset: the language model's shapes, the pattern, then the mixer's and experts', a few to a line.
# fmt: off
PRESETS = {
    "tiny-nemotron-h": HybridSizes(layers=5),
    # Nemotron-3-Nano-30B-A3B's language model (the LM of Nemotron Omni 30B-A3B): 52 layers,
    # 23 Mamba-2, 23 MoE (128 routed experts, top-6, one shared), 6 attention (GQA 32/2)
    # (shapes as published in its config.json; check them against the checkpoint you train).
    # The loader refuses its `E` layers until MoE is built; GPU benchmarks cut the pattern.
    "nemotron-h-30b-a3b": HybridSizes(
        vocab_size=131072, hidden=2688, intermediate=1856, heads=32, kv_heads=2, head_dim=128,
        max_positions=262144, layers=52,
        pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        mamba_heads=64, mamba_head_dim=64, mamba_groups=8, state=128, chunk=128,
        experts=128, topk=6, expert_intermediate=1856, shared_expert_intermediate=3712,
    ),
    # Its dense cut for today's loader: the same widths, Mamba/attention/MLP in the same order
    "nemotron-h-30b-a3b-dense": HybridSizes(
        vocab_size=131072, hidden=2688, intermediate=1856, heads=32, kv_heads=2, head_dim=128,
        max_positions=262144, layers=52,
        pattern="M-M-M*-M-M-M*-M-M-M*-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M-",
        mamba_heads=64, mamba_head_dim=64, mamba_groups=8, state=128, chunk=128,
    ),
}
# fmt: on
assert tuple(PRESETS) == NEMOTRON_H_PRESET_NAMES, "rlflow/model/presets.py lists the CLI's presets"


def write_tiny_nemotron_h(
    out_dir: str | Path,
    *,
    seed: int,
    lm_head_scale: float = 1.0,
    sizes: HybridSizes = PRESETS["tiny-nemotron-h"],
    device: str = "cpu",
) -> Path:
    """A random Nemotron-H checkpoint (the builtin: `M-*M-`, 128 wide) with the same locally
    built tokenizer and chat template as the other tiny models."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from rlflow.model.tiny import TinyModel, token_ids_config, write_tiny

    if len(sizes.pattern) != sizes.layers:
        raise ValueError(
            f"pattern {sizes.pattern!r} has {len(sizes.pattern)} layers, not {sizes.layers}"
        )

    def config(ids: dict[str, int], tokens: int):
        return NemotronHConfig(
            vocab_size=max(sizes.vocab_size, tokens),
            hidden_size=sizes.hidden,
            intermediate_size=sizes.intermediate,
            hybrid_override_pattern=sizes.pattern,
            num_attention_heads=sizes.heads,
            num_key_value_heads=sizes.kv_heads,
            head_dim=sizes.head_dim,
            max_position_embeddings=sizes.max_positions,
            mamba_num_heads=sizes.mamba_heads,
            mamba_head_dim=sizes.mamba_head_dim,
            n_groups=sizes.mamba_groups,
            ssm_state_size=sizes.state,
            chunk_size=sizes.chunk,
            expand=sizes.mamba_heads * sizes.mamba_head_dim // sizes.hidden,
            n_routed_experts=sizes.experts or 8,
            num_experts_per_tok=sizes.topk or 2,
            moe_intermediate_size=sizes.expert_intermediate or sizes.intermediate,
            moe_shared_expert_intermediate_size=sizes.shared_expert_intermediate
            or sizes.intermediate,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=sizes.tie_embeddings,
            use_mamba_kernels=False,
            **token_ids_config(ids),
        )

    def mixers(model) -> None:
        # HF clamps dt (after softplus) at time_step_min, megatron-core's mixer does not: a
        # dt_bias near zero keeps every dt far above the clamp, so both compute the same.
        for layer in model.model.layers:
            if hasattr(layer.mixer, "dt_bias"):
                layer.mixer.dt_bias.zero_()

    tiny = TinyModel(NemotronHForCausalLM, config, bos=False, init=mixers)
    return write_tiny(out_dir, tiny, sizes, seed=seed, device=device, lm_head_scale=lm_head_scale)
