"""Model families: what rlflow needs to know about one kind of checkpoint, asked in one place.

A family (one module each: qwen25vl.py, qwen2vl.py, qwen_text.py, qwen3vl.py, qwen3vl_moe.py, qwen3_moe.py,
nemotron_h/, nemotron_omni/)
says whether the model is multimodal, how media become tokens (placeholder ids, merge size, the
checked prompt ids), the rotary positions of a batch, what the vision tower gives the language
model, how it loads through megatron-bridge (provider settings, fast paths to install) and how
it maps to HF (transformers class, in-memory weight names, extra `generate` inputs), and it
writes its tiny builtin checkpoint. Every other module asks the family instead of inspecting
the model itself: no caller tests a tag (`rope` only describes the family).

The methods that compute on tensors import torch lazily, inside the method: the login node's
dry run imports every family module (the registry) and never torch.

The registry is keyed by the checkpoint's HF `model_type` (config.json) and by the builtin name
(`model.checkpoint: builtin:<name>`). Family modules are imported lazily (they import this one):
adding a family is a new module plus one line in `_FAMILY_MODULES`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from rlflow.errors import Diagnostic, RlflowError
from rlflow.frozen import frozen

if TYPE_CHECKING:
    from rlflow.model.media import Media, Prompt

# Families shipped with rlflow, in the order their builtins are listed.
_FAMILY_MODULES = (
    "rlflow.model.families.qwen25vl",
    "rlflow.model.families.qwen_text",
    "rlflow.model.families.qwen2vl",
    "rlflow.model.families.qwen3vl",
    "rlflow.model.families.qwen3vl_moe",
    "rlflow.model.families.qwen3_moe",
    "rlflow.model.families.nemotron_h",
    "rlflow.model.families.nemotron_omni",
)


@frozen
class MediaTokens:
    """The model's media placeholder ids; -1 (never a token) for text-only models."""

    image: int
    video: int
    merge_size: int  # visual embeddings per pad token = patches / merge_size**2


class ModelFamily:
    """One kind of checkpoint. Subclasses set the class attributes and override what differs.

    The defaults are a text-only model with plain (1-D) RoPE."""

    model_types: ClassVar[tuple[str, ...]]  # HF config.json `model_type`s this family loads
    architectures: ClassVar[tuple[str, ...]]  # HF config.json `architectures`
    builtins: ClassVar[tuple[str, ...]] = ()  # `builtin:<name>` checkpoints this family writes
    # ... with `write_tiny`, and `builtin_config(name)`: the config.json keys of its sizes that
    # the dry run reads (heads, layers, positions, experts: rlflow.model.shape), no torch.
    multimodal: ClassVar[bool]
    # Descriptive only (nothing branches on it): "1d" plain RoPE, "mrope" 3-D (t, h, w) positions
    # from media grids, "mrope-interleaved" the same with the axes interleaved over frequencies.
    rope: ClassVar[Literal["1d", "mrope", "mrope-interleaved"]]
    # Whether rlflow's Megatron generation engine serves it (Nemotron-H's Mamba state it holds:
    # rlflow/generation/megatron/hybrid_decoder.py): the recipe rule `generation.megatron-engine`
    # reads it, no torch.
    megatron_engine: ClassVar[bool] = True

    # --- media -> tokens ---------------------------------------------------------------------------

    def media_tokens(self, hf_config) -> MediaTokens:
        return MediaTokens(-1, -1, 1)

    def prompt_ids(self, prompt: Prompt, tokens: MediaTokens) -> list[int]:
        """The prompt's token ids as every backend and the trainer consume them, checked against
        its media (a vision-language family: one pad token per visual embedding)."""
        if prompt.media.num_images or prompt.media.num_videos:
            raise ValueError(f"prompt {prompt.sample_id}: a text-only model was given media")
        return list(prompt.token_ids)

    # --- the language model's inputs (torch, imported lazily) ------------------------------------

    def positions(self, core, input_ids, attention_mask, media: Media, prompt_mask=None):
        """Rotary positions of a padded batch [B, T]: [B, T] (1-D) or [3, B, T] (mrope).

        prompt_mask [B, T] marks prompt tokens (media pad tokens outside it are generated text).
        1-D: megatron-core numbers RoPE positions 0..T-1 itself, so rows must be right-padded."""
        import torch

        if media.num_images or media.num_videos:
            raise ValueError("a text-only model was given images or video")
        valid = attention_mask.bool()
        if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
            raise ValueError("text-only models need right-padded rows (padding after the tokens)")
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)

    def vision_features(self, core, media: Media):
        """One batched run of the vision tower: (image, video) rows, one per pad token, in item
        order; each row is [H * (1 + deepstack layers)]: the embedding written at the pad token,
        then the features added to the first layers' hidden states (rlflow/model/families/qwen3vl/deepstack.py)."""
        raise ValueError("a text-only model was given images or video")

    # --- loading through megatron-bridge -----------------------------------------------------------

    def register_bridge(self) -> None:
        """Make megatron-bridge's AutoBridge know this architecture (most already do)."""

    def configure_provider(self, provider, hf_config, model_cfg) -> None:
        """Family-specific settings on megatron-bridge's provider, before `finalize()`."""

    def install(self, core) -> None:
        """Family-specific fast paths on a built model (e.g. batched vision attention)."""

    # --- HF side ---------------------------------------------------------------------------------

    def hf_class(self):
        """The transformers class that loads this checkpoint (the HF generation backend): the
        one its architecture names; AutoModelForCausalLM for a family of several."""
        import transformers

        if len(self.architectures) == 1:
            return getattr(transformers, self.architectures[0])
        return transformers.AutoModelForCausalLM

    def hf_module_name(self, exported: str) -> str:
        """On-disk name (what the bridge exports) -> the HF model's in-memory parameter name."""
        return exported

    def hf_state_dict(self, exported: dict) -> dict:
        """The bridge's export (on-disk names) as the HF model's in-memory state dict."""
        return {self.hf_module_name(name): tensor for name, tensor in exported.items()}

    def hf_generate_inputs(self, input_ids, tokens: MediaTokens) -> dict[str, Any]:
        """Extra inputs HF's `generate` needs for a padded batch of prompt ids [B, T]."""
        return {}

    # --- tiny builtin checkpoint -------------------------------------------------------------------

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        raise NotImplementedError(f"{type(self).__name__} has no builtin checkpoint")


_loaded: list[ModelFamily] | None = None


def families() -> list[ModelFamily]:
    """Every registered family, one instance each."""
    global _loaded
    if _loaded is None:
        _loaded = [importlib.import_module(m).FAMILY for m in _FAMILY_MODULES]
    return _loaded


def builtin_names() -> list[str]:
    return [name for f in families() for name in f.builtins]


def by_builtin(name: str) -> ModelFamily | None:
    return next((f for f in families() if name in f.builtins), None)


BUILTIN_PREFIX = "builtin:"


def unknown_builtin(checkpoint: str) -> Diagnostic | None:
    """The one rule for `model.checkpoint: builtin:<name>`: the name must be a family's builtin.

    Run by the recipe checks (`submit --dry-run` and `train`) and by `build.resolve_checkpoint`.
    Imports only the family modules, which import no torch (login nodes run it)."""
    if not checkpoint.startswith(BUILTIN_PREFIX):
        return None
    name = checkpoint[len(BUILTIN_PREFIX) :]
    if by_builtin(name) is not None:
        return None
    known = ", ".join(BUILTIN_PREFIX + b for b in builtin_names())
    return Diagnostic(
        "model.unknown-builtin",
        f"`model.checkpoint` is `{checkpoint}`, which names no built-in model",
        help=f"built-in models: {known}; or set model.checkpoint to an HF checkpoint directory",
    )


def by_config(config: dict[str, Any]) -> ModelFamily | None:
    """The family of a parsed config.json (its `model_type`, else its `architectures`)."""
    for f in families():
        if config.get("model_type") in f.model_types:
            return f
    archs = set(config.get("architectures") or [])
    return next((f for f in families() if archs & set(f.architectures)), None)


def supported_architectures() -> list[str]:
    return [a for f in families() for a in f.architectures]


def of_checkpoint(checkpoint: Path | str) -> ModelFamily:
    """The family of an HF checkpoint directory, or a diagnostic naming the supported ones."""
    config_path = Path(checkpoint) / "config.json"
    config = json.loads(config_path.read_text())
    family = by_config(config)
    if family is None:
        raise RlflowError(
            Diagnostic(
                "model.unsupported",
                f"checkpoint `{checkpoint}` is {config.get('architectures') or []} "
                f"(model_type `{config.get('model_type')}`), which rlflow does not train yet",
                help="supported architectures: " + ", ".join(supported_architectures()),
            )
        )
    return family


def of_core(core) -> ModelFamily:
    """The family of a model built by `rlflow.model.build.load_policy` (it tags the model)."""
    family = getattr(core, "rlflow_family", None)
    if family is None:
        raise TypeError(
            f"{type(core).__name__} has no model family: build it with "
            "rlflow.model.build.load_policy"
        )
    return family


# --- shared by the family modules (model/families/): what families used to copy from each other


def provide_frozen(provider, model):
    """`model`, frozen as its megatron-bridge provider's three flags say: the end of every
    vision-language provider's `provide()` (rlflow sets the flags in `configure_provider`)."""
    if (
        provider.freeze_language_model
        or provider.freeze_vision_model
        or provider.freeze_vision_projection
    ):
        model.freeze(
            freeze_language_model=provider.freeze_language_model,
            freeze_vision_model=provider.freeze_vision_model,
            freeze_vision_projection=provider.freeze_vision_projection,
        )
    return model


# HF's methods a Qwen-VL megatron model borrows (bound to it): media features and positions.
HF_VL_METHODS = (
    "get_placeholder_mask",
    "get_image_features",
    "get_video_features",
    "get_rope_index",
    "get_vision_position_ids",
)


def init_vl_model(model, config, pre_process, post_process, vp_stage, tower) -> None:
    """The start of a Qwen-VL megatron model's `__init__`: HF's vision `tower` class on the first
    pipeline stage, megatron-core's language model from the provider `config`."""
    from megatron.bridge.utils.common_utils import hook_hf_module_setattr_for_tp_grad_sync
    from megatron.core.transformer.module import MegatronModule

    MegatronModule.__init__(model, config=config)  # not Qwen25VLModel's: another tower
    model.pre_process, model.post_process, model.vp_stage = pre_process, post_process, vp_stage
    if pre_process:
        model.visual = tower._from_config(config.vision_config)
        hook_hf_module_setattr_for_tp_grad_sync(model.visual)
    model.language_model = config.provide_language_model(
        pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
    )


def finish_vl_model(model, config, hf_model) -> None:
    """The end of a Qwen-VL megatron model's `__init__`: shared embeddings, and `hf_model`'s
    HF_VL_METHODS bound to the model."""
    import types

    model.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
    model.shared_embedding_or_output_weight = model.language_model.shared_embedding_or_output_weight
    for name in HF_VL_METHODS:
        setattr(model, name, types.MethodType(getattr(hf_model, name), model))
