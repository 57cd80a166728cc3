"""Nemotron-H text: a hybrid of Mamba-2 mixers, attention, MLP and MoE layers (megatron-core's
HybridModel), the language model of Nemotron Omni.

The layer pattern (HF `hybrid_override_pattern`, e.g. `M-M*-`) says each layer's kind: `M` a
Mamba-2 mixer, `*` attention (no positional encoding: the Mamba layers carry order), `-` a
squared-ReLU MLP, `E` a mixture of experts (squared-ReLU routed experts under a sigmoid router
with a correction bias, plus a shared expert). Every layer is pre-norm (RMSNorm) with a
residual.

Which path runs where: rlflow's bridge registration (model.py) keeps megatron-bridge's
`NemotronHBridge` mappings and provider with a local (non-TE) stack spec, on every machine; the
Mamba mixer runs `mamba-ssm`'s CUDA kernels where installed, else rlflow's PyTorch reference
(docs/hybrid-kernels.md). Text only, right-padded rows (a Mamba layer reads every token before
it: left padding would enter the state).

Limits: tensor and expert parallelism work; context, pipeline and sequence parallelism are
refused. Both generation backends run the dense layers: the Megatron engine holds the Mamba
layers' conv and SSM states per row (rlflow/generation/megatron/hybrid_decoder.py); a pattern
with `E` (MoE) layers generates with `generation.backend: hf` until the engine's decoder runs
them (docs/hybrid-kernels.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rlflow.model.family import ModelFamily
from rlflow.model.presets import NEMOTRON_H_PRESET_NAMES
from rlflow.model.tiny import LanguageSizes, language_config

# a routed expert's weight on disk (the bridge's export): one tensor per expert
_EXPERT = re.compile(r"^(backbone\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up|down)_proj\.weight$")


class NemotronH(ModelFamily):
    model_types = ("nemotron_h",)
    architectures = ("NemotronHForCausalLM",)
    builtins = ("tiny-nemotron-h", "tiny-nemotron-h-moe")
    multimodal = False
    rope = "1d"  # descriptive: attention has no rotary; positions are unused

    def register_bridge(self) -> None:
        from rlflow.model.families.nemotron_h import model

        model.register()

    def configure_provider(self, provider, hf_config, model_cfg) -> None:
        from rlflow.model.families.nemotron_h import model

        model.check_parallelism(provider)
        model.configure_moe(provider, hf_config, model_cfg)

    def install(self, core) -> None:
        from rlflow.model.families.nemotron_h import model

        model.install(core)

    def hf_module_name(self, exported: str) -> str:
        """On disk `backbone.*` (the checkpoint's names); in transformers 5's memory `model.*`."""
        if exported.startswith("backbone."):
            return "model." + exported[len("backbone.") :]
        return exported

    def hf_state_dict(self, exported: dict) -> dict:
        """On-disk names and per-expert tensors -> HF's in-memory state dict: `model.*`, the
        routed experts of each MoE layer stacked (`experts.up_proj` [E, F, H],
        `experts.down_proj` [E, H, F])."""
        import torch

        out, experts = {}, {}
        for name, tensor in exported.items():
            match = _EXPERT.match(name)
            if match is None:
                out[self.hf_module_name(name)] = tensor
                continue
            prefix, index, kind = match.group(1), int(match.group(2)), match.group(3)
            experts.setdefault(prefix, {}).setdefault(kind, {})[index] = tensor
        for prefix, kinds in experts.items():
            for kind, tensors in kinds.items():
                stacked = torch.stack([tensors[e] for e in sorted(tensors)])
                out[self.hf_module_name(f"{prefix}.{kind}_proj")] = stacked
        return out

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        return write_tiny_nemotron_h(
            out_dir, seed=seed, lm_head_scale=lm_head_scale, sizes=PRESETS[name]
        )

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.shape import builtin_keys

        sizes = PRESETS[name]
        keys = builtin_keys(
            sizes,
            max_positions=sizes.max_positions,
            experts=sizes.experts,
            topk=sizes.topk,
            multimodal=False,
        )
        mixer = {"mamba_num_heads": sizes.mamba_heads, "n_groups": sizes.mamba_groups}
        return {**keys, **mixer, "hybrid_override_pattern": sizes.pattern}


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
    experts: int = 0  # routed experts of the `E` layers
    topk: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    routed_scaling: float = 1.0  # the router's weights x this (HF routed_scaling_factor)
    expert_groups: int = 1  # group-limited routing: groups of experts (n_group) ...
    topk_groups: int = 1  # ... of which each token's experts come from this many (topk_group)


# A preset: the language model's shapes, the pattern, then the mixer's and experts', a few to a line.
# fmt: off
PRESETS = {
    "tiny-nemotron-h": HybridSizes(layers=5),
    # the same with two MoE layers: 8 routed experts top-2 in 2 groups (1 chosen per token),
    # squared-ReLU experts, a shared expert, sigmoid scores with a correction bias, scaling 2.5
    "tiny-nemotron-h-moe": HybridSizes(
        layers=5, pattern="ME*E-", experts=8, topk=2, expert_intermediate=64,
        shared_expert_intermediate=96, routed_scaling=2.5, expert_groups=2, topk_groups=1,
    ),
    # Nemotron-3-Nano-30B-A3B's language model (the LM of Nemotron Omni 30B-A3B): 52 layers,
    # 23 Mamba-2, 23 MoE (128 routed experts, top-6, one shared), 6 attention (GQA 32/2)
    # (shapes as published in its config.json; check them against the checkpoint you train).
    # Router: sigmoid, top-6 of 128 in one group, weights x 2.5 (megatron-bridge's recipe
    # nemotron_3_nano.py). GPU benchmarks cut the pattern.
    "nemotron-h-30b-a3b": HybridSizes(
        vocab_size=131072, hidden=2688, intermediate=1856, heads=32, kv_heads=2, head_dim=128,
        max_positions=262144, layers=52,
        pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        mamba_heads=64, mamba_head_dim=64, mamba_groups=8, state=128, chunk=128,
        experts=128, topk=6, expert_intermediate=1856, shared_expert_intermediate=3712,
        routed_scaling=2.5,
    ),
    # Its first 8 layers (4 Mamba-2, 3 MoE, 1 attention; 4.8 B parameters): what one GPU
    # holds with the reference and the optimizer, for benchmarks
    "nemotron-h-30b-a3b-8l": HybridSizes(
        vocab_size=131072, hidden=2688, intermediate=1856, heads=32, kv_heads=2, head_dim=128,
        max_positions=262144, layers=8, pattern="MEMEM*EM",
        mamba_heads=64, mamba_head_dim=64, mamba_groups=8, state=128, chunk=128,
        experts=128, topk=6, expert_intermediate=1856, shared_expert_intermediate=3712,
        routed_scaling=2.5,
    ),
    # Its dense cut: the same widths, Mamba/attention/MLP in the same order (MLPs for the MoE)
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
    """A random Nemotron-H checkpoint (the builtin: `M-*M-`, 128 wide; `sizes` another preset)
    with the same locally built tokenizer and chat template as the other tiny models."""
    from transformers import NemotronHForCausalLM

    from rlflow.model.tiny import TinyModel, token_ids_config, write_tiny

    def config(ids: dict[str, int], tokens: int):
        return hf_config(sizes, token_ids_config(ids), tokens)

    def mixers(model) -> None:
        init_tiny_layers(model.model.layers, sizes)

    tiny = TinyModel(NemotronHForCausalLM, config, bos=False, init=mixers)
    return write_tiny(out_dir, tiny, sizes, seed=seed, device=device, lm_head_scale=lm_head_scale)


def init_tiny_layers(layers, sizes: HybridSizes) -> None:
    """A random tiny model's Mamba mixers and routers (HF's Nemotron-H `layers`; Nemotron Omni's
    language model calls it too). HF clamps dt (after softplus) at time_step_min, megatron-core's
    mixer does not: a dt_bias near zero keeps every dt far above the clamp, so both compute the
    same. HF's router starts at zero (every score 0.5: choices decided by rounding); a wide
    random router and correction bias make every token's top-k clear and the bias count."""
    for layer in layers:
        if hasattr(layer.mixer, "dt_bias"):
            layer.mixer.dt_bias.zero_()
        if hasattr(layer.mixer, "gate"):  # logits of about the same spread at any width
            layer.mixer.gate.weight.normal_(0.0, 0.5 * (128 / sizes.hidden) ** 0.5)
            layer.mixer.gate.e_score_correction_bias.normal_(0.0, 0.1)


def hf_config(sizes: HybridSizes, token_ids: dict | None = None, tokens: int = 0):
    """The transformers `NemotronHConfig` of `sizes` (`token_ids`: pad/eos/bos ids of a
    tokenizer of `tokens` entries; a config alone, e.g. for the provider, needs neither)."""
    from transformers import NemotronHConfig

    if len(sizes.pattern) != sizes.layers:
        raise ValueError(
            f"pattern {sizes.pattern!r} has {len(sizes.pattern)} layers, not {sizes.layers}"
        )
    widths = language_config(sizes, tokens)
    del widths["num_hidden_layers"]  # the pattern's length (deprecated in NemotronHConfig)
    return NemotronHConfig(
        **widths,
        hybrid_override_pattern=sizes.pattern,
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
        moe_shared_expert_intermediate_size=sizes.shared_expert_intermediate or sizes.intermediate,
        routed_scaling_factor=sizes.routed_scaling,
        n_group=sizes.expert_groups,
        topk_group=sizes.topk_groups,
        norm_topk_prob=True,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=sizes.tie_embeddings,
        use_mamba_kernels=False,
        **(token_ids or {}),
    )
