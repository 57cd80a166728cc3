"""A checkpoint's language-model shape as the recipe rules need it, read without torch.

The dry run (login node) and `rlflow train` (before any model is built) check recipe settings
against the model: tensor parallelism must split the attention heads and KV heads evenly,
expert parallelism the experts, `model.moe.router_topk` must pick among the experts, a prompt
plus its generation must fit the model's positions, and the KV cache must fit in memory. They ask
`recipe_shape(model.checkpoint)`: an HF directory's config.json (a vision-language config keeps
the language model's keys in `text_config`), or a built-in's own sizes (its family's
`builtin_config`: nothing is written or imported to ask).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlflow.frozen import frozen

_MAX_CONFIG_BYTES = 4 << 20  # a config.json is a few KB; a larger "config" is not one
# HF config keys that hold the number of routed experts, by family (Qwen, Mixtral, DeepSeek).
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk")


@frozen
class ModelShape:
    """The language model's sizes (0: the config does not say)."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    max_positions: int  # max_position_embeddings: positions the model was built for
    experts: int  # routed experts per layer (0: a dense model)
    topk: int  # experts per token (0: a dense model)
    multimodal: bool  # a vision (or video) tower: model.freeze_vision means something
    kv_layers: int = -1  # layers that keep a KV cache (-1: all; a hybrid's attention layers)
    mamba_heads: int = 0  # a hybrid's Mamba-2 mixer: heads and B/C groups (TP splits both)
    mamba_groups: int = 0

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """KV-cache bytes one token takes on one tensor-parallel rank (keys and values)."""
        kv_heads = max(self.kv_heads // max(tensor_parallel, 1), 1)
        layers = self.layers if self.kv_layers < 0 else self.kv_layers
        return 2 * layers * kv_heads * self.head_dim * dtype_bytes


def builtin_keys(
    sizes: Any, *, max_positions: int, experts: int = 0, topk: int = 0, multimodal: bool = True
) -> dict[str, Any]:
    """The config.json keys `shape_of_config` reads, for a family's builtin of `sizes` (a sizes
    dataclass with hidden, heads, kv_heads, layers and maybe head_dim)."""
    keys = {
        "num_attention_heads": sizes.heads,
        "num_key_value_heads": sizes.kv_heads,
        "head_dim": getattr(sizes, "head_dim", 0) or sizes.hidden // sizes.heads,
        "num_hidden_layers": sizes.layers,
        "max_position_embeddings": max_positions,
        "num_experts": experts,
        "num_experts_per_tok": topk,
    }
    if multimodal:
        keys["vision_config"] = {}
    return keys


def hybrid_block_types(section: dict[str, Any]) -> list[str] | None:
    """A hybrid's layer kinds (`mamba`, `attention`, `mlp`, `moe`) from Nemotron-H's
    `layers_block_type` list (transformers 5) or `hybrid_override_pattern` string (`M*-E`);
    None for a model whose layers are all alike."""
    listed = section.get("layers_block_type")
    if isinstance(listed, list) and all(isinstance(kind, str) for kind in listed):
        renamed = {"linear_attention": "mamba", "full_attention": "attention"}
        return [renamed.get(kind, kind) for kind in listed]
    pattern = section.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        symbols = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        return [symbols.get(symbol, symbol) for symbol in pattern]
    return None


def language_sections(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Where a parsed HF config.json keeps the language model's keys, first match first:
    `text_config` (Qwen-VL), Nemotron Omni's `llm_config`, then the top level."""
    language = (config.get("text_config"), config.get("llm_config"), config)
    return [s for s in language if isinstance(s, dict)]


def hybrid_blocks(config: dict[str, Any]) -> list[str] | None:
    """The language model's layer kinds (`hybrid_block_types`) of a parsed config.json, in
    whichever section holds them; None for a model whose layers are all alike."""
    return next((b for b in map(hybrid_block_types, language_sections(config)) if b), None)


def shape_of_config(config: dict[str, Any]) -> ModelShape:
    """The shape of a parsed HF config.json (language keys first from `text_config`, or
    Nemotron Omni's `llm_config`)."""
    sections = language_sections(config)

    def number(*keys: str) -> int:
        for section in sections:
            for key in keys:
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return 0

    heads = number("num_attention_heads", "n_head")
    hidden = number("hidden_size", "n_embd")
    experts = number(*_EXPERT_KEYS)
    layers = number("num_hidden_layers", "n_layer")
    kv_layers = -1
    blocks = hybrid_blocks(config)
    if blocks is not None:  # a hybrid: experts only where a layer is one; KV in attention only
        layers, kv_layers = len(blocks), blocks.count("attention")
        experts = experts if "moe" in blocks else 0
    return ModelShape(
        heads=heads,
        kv_heads=number("num_key_value_heads") or heads,
        head_dim=number("head_dim") or (hidden // heads if heads else 0),
        layers=layers,
        max_positions=number("max_position_embeddings", "n_positions"),
        experts=experts,
        topk=number(*_TOPK_KEYS) if experts else 0,
        multimodal=isinstance(config.get("vision_config"), dict),
        kv_layers=kv_layers,
        mamba_heads=number("mamba_num_heads") if blocks and "mamba" in blocks else 0,
        mamba_groups=number("n_groups") if blocks and "mamba" in blocks else 0,
    )


def recipe_shape(checkpoint: str) -> ModelShape | None:
    """The shape of `model.checkpoint`: a built-in's (its family's `builtin_config`) or an HF
    directory's config.json; None when there is nothing to read (an unknown builtin, a path not
    on this machine, a config that is not a small JSON file): the rules that need it then say
    nothing, and the model loader reports the checkpoint itself."""
    from rlflow.model import family as families

    if checkpoint.startswith(families.BUILTIN_PREFIX):
        name = checkpoint[len(families.BUILTIN_PREFIX) :]
        sized = getattr(families.by_builtin(name), "builtin_config", None)
        return None if sized is None else shape_of_config(sized(name))
    config = Path(checkpoint).expanduser() / "config.json"
    try:
        if not config.is_file() or config.stat().st_size > _MAX_CONFIG_BYTES:
            return None  # (a FIFO or device is not a regular file: never opened)
        parsed = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return shape_of_config(parsed) if isinstance(parsed, dict) else None
