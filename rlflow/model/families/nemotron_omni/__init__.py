"""Nemotron Omni: a RADIO vision tower + a projector (`mlp1`) + the Nemotron-H hybrid language
model (Mamba-2, attention and MLP layers), with images and video frames.

What it is made of, and where it lives:
- the HF side (hf.py): transformers' `RadioModel` and `NemotronHForCausalLM` joined by `mlp1`,
  registered with transformers' Auto classes under the checkpoint's `model_type`
  (`NemotronH_Nano_Omni_Reasoning_V3`; transformers 5.17 has no class of its own for it). It
  reads and writes the layout megatron-bridge's Omni bridge reads;
- the Megatron side (model.py): megatron-bridge 0.6.2's Omni provider builds megatron-core's
  LLaVA model with a Transformer Engine vision spec (`get_vit_layer_with_transformer_engine_spec`),
  absent here and on the lent GPUs. So, as for Qwen3-VL, rlflow registers its own bridge: HF's
  RADIO tower and rlflow's `mlp1` kept as modules, megatron-core's `HybridModel` as the language
  model (Nemotron-H's local stack spec and Mamba kernels: rlflow/model/families/nemotron_h/),
  megatron-bridge's Nemotron-H mappings for the language model;
- media: Qwen-VL-layout patches (16 pixels, 2 x 2 groups, one frame to a temporal patch): each
  frame runs through RADIO, is pixel-shuffled 2 x 2 and projected: one pad token per 2 x 2
  patches. Video frames are images to the tower (no temporal patch embedder).

Generation: every backend. rlflow's Megatron engine takes Omni as it takes the Qwen-VL families:
its packed prefill embeds the prompts with `vision_features` (below) placed at the image and
video pad tokens (rlflow/generation/megatron/prefill.py, through the policy's vision cache: one
tower run per prompt, shared by its samples), and its hybrid decoder runs the language model
with each row's Mamba state beside the paged KV cache
(rlflow/generation/megatron/hybrid_decoder.py); what that decoder refuses (its docstring says)
it refuses for Omni's language model too.

Limits: audio is refused (no sound encoder is built: a checkpoint's `sound_config` is refused
at load, and the server refuses `input_audio` parts); a checkpoint with a separate (temporal)
video patch embedder is refused; text rows are right-padded (the Mamba state); one
model-parallel rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError
from rlflow.model.families.nemotron_h import PRESETS as HYBRID_PRESETS
from rlflow.model.families.nemotron_h import HybridSizes
from rlflow.model.families.qwen25vl import QwenVLFamily
from rlflow.model.family import MediaTokens, ModelFamily
from rlflow.model.presets import NEMOTRON_OMNI_PRESET_NAMES

MODEL_TYPE = "NemotronH_Nano_Omni_Reasoning_V3"


class NemotronOmni(ModelFamily):
    model_types = (MODEL_TYPE,)
    architectures = (MODEL_TYPE,)
    builtins = ("tiny-nemotron-omni",)
    multimodal = True
    rope = "1d"  # descriptive: attention has no rotary; positions are unused

    def media_tokens(self, hf_config) -> MediaTokens:
        video = getattr(hf_config, "video_context_token_id", None)
        return MediaTokens(hf_config.img_context_token_id, -1 if video is None else video, 2)

    prompt_ids = QwenVLFamily.prompt_ids  # one pad token per 2 x 2 patches, counts checked

    def positions(self, core, input_ids, attention_mask, media, prompt_mask=None):
        """[B, T] positions (unused: no rotary); rows must be right-padded (the Mamba state)."""
        import torch

        valid = attention_mask.bool()
        if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
            raise ValueError("Nemotron Omni needs right-padded rows (padding after the tokens)")
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)

    def vision_features(self, core, media):
        from rlflow.model.families.nemotron_omni.hf import media_rows

        out = []
        for pixels, grid in (
            (media.pixel_values, media.image_grid_thw),
            (media.pixel_values_videos, media.video_grid_thw),
        ):
            out.append(
                None if pixels is None else media_rows(core.vision_model, core.mlp1, pixels, grid)
            )
        return out[0], out[1]

    def register_bridge(self) -> None:
        from rlflow.model.families.nemotron_omni import model

        model.register()

    def configure_provider(self, provider, hf_config, model_cfg) -> None:
        from rlflow.model.families.nemotron_h import model as hybrid

        hybrid.check_parallelism(provider)
        provider.freeze_vision_model = model_cfg.freeze_vision
        provider.freeze_vision_projection = model_cfg.freeze_vision
        provider.freeze_language_model = False

    def install(self, core) -> None:
        from rlflow.model.families.nemotron_h import model as hybrid

        hybrid.install(core.language_model)

    def hf_class(self):
        from rlflow.model.families.nemotron_omni.hf import NemotronH_Nano_Omni_Reasoning_V3

        return NemotronH_Nano_Omni_Reasoning_V3

    def hf_module_name(self, exported: str) -> str:
        """On disk (the bridge's names) -> transformers' in-memory names (hf.py's model)."""
        from rlflow.model.families.nemotron_omni.model import hf_module_name

        return hf_module_name(exported)

    def hf_state_dict(self, exported: dict) -> dict:
        from rlflow.model.families.nemotron_omni.model import hf_state_dict

        return hf_state_dict(exported)

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        return write_tiny_nemotron_omni(out_dir, seed=seed, lm_head_scale=lm_head_scale)

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.shape import builtin_keys

        sizes = PRESETS["tiny-nemotron-omni"]
        keys = builtin_keys(sizes, max_positions=sizes.max_positions)
        mixer = {"mamba_num_heads": sizes.mamba_heads, "n_groups": sizes.mamba_groups}
        return {**keys, **mixer, "hybrid_override_pattern": sizes.pattern}


FAMILY = NemotronOmni()


def refuse(problem: str, fix: str) -> None:
    raise RlflowError(Diagnostic("model.nemotron-omni-unsupported", problem, help=fix))


@dataclass(frozen=True)
class OmniSizes(HybridSizes):
    """Shapes of a random Nemotron Omni: Nemotron-H's, RADIO's and the projector's."""

    vision_hidden: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    vision_cls_tokens: int = 2
    vision_registers: int = 2
    vision_max_img_size: int = 512  # the position table covers 32 x 32 patches
    projector_hidden: int = 256


# fmt: off
PRESETS = {
    "tiny-nemotron-omni": OmniSizes(layers=5),
    # Nemotron Omni 30B-A3B: Nemotron-3-Nano-30B-A3B's language model (Nemotron-H's preset
    # nemotron-h-30b-a3b, its router included) under C-RADIO (ViT-H/16: 32 layers, 1280 wide,
    # 3 class + 7 register tokens) and a 20480-wide projector (shapes as megatron-bridge's Omni
    # provider builds them; check them against the checkpoint you train).
    "nemotron-omni-30b-a3b": OmniSizes(
        **asdict(HYBRID_PRESETS["nemotron-h-30b-a3b"]),
        vision_hidden=1280, vision_layers=32, vision_heads=16, vision_cls_tokens=3,
        vision_registers=7, vision_max_img_size=2048, projector_hidden=20480,
    ),
}
# fmt: on
assert tuple(PRESETS) == NEMOTRON_OMNI_PRESET_NAMES, "rlflow/model/presets.py lists the presets"


def write_tiny_nemotron_omni(
    out_dir: str | Path,
    *,
    seed: int,
    lm_head_scale: float = 1.0,
    sizes: OmniSizes = PRESETS["tiny-nemotron-omni"],
    device: str = "cpu",
) -> Path:
    """A random Nemotron Omni checkpoint in the layout megatron-bridge's Omni bridge reads (the
    builtin: Nemotron-H `M-*M-` 128 wide under a 2-layer, 64-wide RADIO), with the tiny
    tokenizer and chat template and a Qwen2-VL-style processor (16-pixel patches, 2 x 2 groups,
    one frame to a temporal patch, pixels in [0, 1]: RADIO normalises them)."""
    from transformers import RadioConfig

    from rlflow.model.families.nemotron_h import hf_config, init_tiny_layers
    from rlflow.model.families.nemotron_omni import hf
    from rlflow.model.tiny import TinyModel, token_ids_config, write_tiny

    def config(ids: dict[str, int], tokens: int):
        vision = RadioConfig(
            hidden_size=sizes.vision_hidden,
            num_hidden_layers=sizes.vision_layers,
            num_attention_heads=sizes.vision_heads,
            patch_size=16,
            max_img_size=sizes.vision_max_img_size,
            num_cls_tokens=sizes.vision_cls_tokens,
            num_registers=sizes.vision_registers,
        )
        return hf.NemotronOmniConfig(
            llm_config=hf_config(sizes, token_ids_config(ids), tokens),  # Nemotron-H's
            vision_config=vision,
            projector_hidden_size=sizes.projector_hidden,
            img_context_token_id=ids["<|image_pad|>"],
            video_context_token_id=ids["<|video_pad|>"],
            tie_word_embeddings=False,
        )

    def mixers(model) -> None:
        init_tiny_layers(model.language_model.model.layers, sizes)  # as Nemotron-H's tiny model

    tiny = TinyModel(
        hf.NemotronH_Nano_Omni_Reasoning_V3,
        config,
        bos=False,
        init=mixers,
        save_processor=_save_processor,
    )
    return write_tiny(out_dir, tiny, sizes, seed=seed, device=device, lm_head_scale=lm_head_scale)


def _save_processor(out: Path, tokenizer) -> None:
    """Qwen2-VL's processors at 16-pixel patches, 2 x 2 groups, one frame a temporal patch, no
    normalisation: 32 x 32 .. 256 x 256 pixels per image (a 112 x 112 image gives 16 tokens)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from rlflow.model.tiny import CHAT_TEMPLATE

    plain = dict(image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0])
    image_processor = Qwen2VLImageProcessor(
        min_pixels=32 * 32, max_pixels=256 * 256, patch_size=16, merge_size=2,
        temporal_patch_size=1, **plain,
    )  # fmt: skip
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=32 * 32, max_pixels=256 * 256 * 4, patch_size=16, merge_size=2,
        temporal_patch_size=1, do_sample_frames=False, **plain,
    )  # fmt: skip
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
