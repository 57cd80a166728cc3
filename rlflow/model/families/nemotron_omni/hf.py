"""Nemotron Omni on the HF side: transformers' RADIO tower + the projector (`mlp1`) + transformers'
Nemotron-H, registered with transformers' Auto classes.

transformers 5.17 has the two halves (`RadioModel`, `NemotronHForCausalLM`) but not the
checkpoint's own class (`NemotronH_Nano_Omni_Reasoning_V3` is remote code on the hub, which
rlflow never runs). This module is that class for rlflow: it loads and writes the checkpoint
layout megatron-bridge's Omni bridge reads (`vision_model.radio_model.model.*` through
transformers' own RADIO renaming, `mlp1.{0,1,3}`, `language_model.backbone.*` and
`language_model.lm_head`), the HF generation backend runs it, and the parity tests compare
rlflow's Megatron model with it.

Media reach the model in the Qwen-VL layout rlflow's `Media` carries (flattened 16-pixel patches
of each image or video frame, grouped 2 x 2, and a (t, h, w) grid per item; the tiny
checkpoint's processor is Qwen2-VL's with one frame to a temporal patch and no normalisation:
RADIO's input conditioner normalises). Each frame becomes an image again, runs through RADIO,
drops its class and register tokens, is pixel-shuffled 2 x 2 (InternVL's `pixel_shuffle`, v2) and
projected by `mlp1` (RMSNorm, Linear, squared ReLU, Linear) to one row per pad token.
`media_rows` is the one implementation, shared with the Megatron model (model.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    RadioConfig,
    RadioModel,
)
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

MODEL_TYPE = "NemotronH_Nano_Omni_Reasoning_V3"  # the checkpoint's (megatron-bridge's key)
MERGE = 2  # pixel shuffle 0.5: 2 x 2 patches per pad token


class NemotronOmniConfig(PreTrainedConfig):
    model_type = MODEL_TYPE
    sub_configs = {"llm_config": AutoConfig, "vision_config": AutoConfig}

    def __init__(
        self,
        llm_config=None,
        vision_config=None,
        projector_hidden_size: int = 20480,
        downsample_ratio: float = 0.5,
        img_context_token_id: int = 18,
        video_context_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if isinstance(llm_config, dict):
            llm_config = NemotronHConfig(
                **{k: v for k, v in llm_config.items() if k != "model_type"}
            )
        if isinstance(vision_config, dict):
            vision_config = RadioConfig(
                **{k: v for k, v in vision_config.items() if k != "model_type"}
            )
        self.llm_config = llm_config if llm_config is not None else NemotronHConfig()
        self.vision_config = vision_config if vision_config is not None else RadioConfig()
        self.projector_hidden_size = projector_hidden_size
        self.downsample_ratio = downsample_ratio
        self.img_context_token_id = img_context_token_id
        self.video_context_token_id = video_context_token_id
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs):
        return self.llm_config


class SquaredReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


def projector(config: NemotronOmniConfig) -> nn.Sequential:
    """`mlp1`: RMSNorm over the shuffled features, Linear, squared ReLU, Linear (no biases)."""
    width = config.vision_config.hidden_size * MERGE * MERGE
    return nn.Sequential(
        NemotronHRMSNorm(width, eps=1e-5),
        nn.Linear(width, config.projector_hidden_size, bias=False),
        SquaredReLU(),
        nn.Linear(config.projector_hidden_size, config.llm_config.hidden_size, bias=False),
    )


def pixel_shuffle(x: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    """InternVL's pixel shuffle (ps_version v2): [n, H, W, C] -> [n, H/2, W/2, 4C]."""
    n, w, h, c = x.size()
    x = x.view(n, w, int(h * scale), int(c / scale))
    x = x.permute(0, 2, 1, 3).contiguous()
    x = x.view(n, int(h * scale), int(w * scale), int(c / (scale * scale)))
    return x.permute(0, 2, 1, 3).contiguous()


def frames(patches: torch.Tensor, grid: tuple[int, int, int], patch: int) -> torch.Tensor:
    """One item's Qwen-layout patches [t*h*w, C*P*P] (2 x 2 groups) -> frames [t, C, hP, wP]."""
    t, h, w = grid
    channels = patches.shape[-1] // (patch * patch)
    x = patches.view(t, h // MERGE, w // MERGE, MERGE, MERGE, channels, patch, patch)
    return x.permute(0, 5, 1, 3, 6, 2, 4, 7).reshape(t, channels, h * patch, w * patch)


def media_rows(tower, mlp1, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """Rows [pad tokens, H] for one media kind: each item's frames through RADIO (frames of one
    size in one batch), the class and register tokens dropped, pixel-shuffled, projected."""
    patch = tower.config.patch_size
    rows, offset = [], 0
    for t, h, w in grid_thw.tolist():
        count = t * h * w
        x = frames(pixel_values[offset : offset + count], (t, h, w), patch)
        offset += count
        features = tower(pixel_values=x.to(tower.embeddings.patch_projection.weight.dtype)).features
        shuffled = pixel_shuffle(features.reshape(t, h, w, -1))
        rows.append(shuffled.reshape(t * (h // MERGE) * (w // MERGE), -1))
    return mlp1(torch.cat(rows))


def radio_tower(config: RadioConfig) -> RadioModel:
    """transformers' RADIO at `config`. C-RADIO has no LayerScale (HF's is an identity at 1.0,
    and checkpoints hold no weights for it): it is left out here, so no stray parameters train
    or export. The buffers (the input conditioner's mean and std, the summary indices) come from
    the config and are not persistent: megatron-bridge converts parameters only."""
    if config.layerscale_value != 1.0:
        raise ValueError(
            f"RADIO layerscale_value {config.layerscale_value}: C-RADIO has none (1.0)"
        )
    tower = RadioModel._from_config(config)
    for layer in tower.encoder.layer:
        layer.layer_scale1 = nn.Identity()
        layer.layer_scale2 = nn.Identity()
    for module, name in (
        (tower.input_conditioner, "norm_mean"),
        (tower.input_conditioner, "norm_std"),
        (tower, "summary_idxs"),
    ):
        value = getattr(module, name)
        delattr(module, name)
        module.register_buffer(name, value, persistent=False)
    return tower


class NemotronHLanguageModel(NemotronHForCausalLM):
    """transformers' Nemotron-H, whose `generate` takes the embedded prompt: its own
    `prepare_inputs_for_generation` does not name `inputs_embeds`, which `generate` requires
    (the generic one places them in the first step)."""

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, **kwargs):
        return super().prepare_inputs_for_generation(
            input_ids, inputs_embeds=inputs_embeds, **kwargs
        )


class NemotronH_Nano_Omni_Reasoning_V3(PreTrainedModel):  # noqa: N801 - the checkpoint's name
    """RADIO + `mlp1` + Nemotron-H, images and video frames (no sound encoder). Named as the
    checkpoint's `architectures` name its remote class, so config.json reads as a real one's."""

    config_class = NemotronOmniConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _supports_sdpa = True
    _no_split_modules = ["RadioLayer", "NemotronHBlock"]

    def __init__(self, config: NemotronOmniConfig):
        super().__init__(config)
        self.vision_model = radio_tower(config.vision_config)
        self.mlp1 = projector(config)
        self.language_model = NemotronHLanguageModel._from_config(config.llm_config)
        self.post_init()

    @property
    def lm_head(self):
        return self.language_model.lm_head

    def _init_weights(self, module):  # the halves initialise themselves
        if isinstance(module, nn.Linear) and module in set(self.mlp1.modules()):
            nn.init.normal_(module.weight, std=0.02)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def embed(
        self,
        input_ids,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
    ) -> torch.Tensor:
        """Token embeddings with the media rows at the image and video pad tokens."""
        embeds = self.get_input_embeddings()(input_ids)
        for pixels, grid, token in (
            (pixel_values, image_grid_thw, self.config.img_context_token_id),
            (pixel_values_videos, video_grid_thw, self.config.video_context_token_id),
        ):
            if pixels is None:
                continue
            rows = media_rows(self.vision_model, self.mlp1, pixels, grid).to(embeds.dtype)
            slots = (input_ids == token)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(slots, rows)
        return embeds

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        inputs_embeds=None,
        **kwargs,
    ):
        if inputs_embeds is None:
            inputs_embeds = self.embed(
                input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
            )
        return self.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kwargs
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids,
        attention_mask=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        second_per_grid_ts=None,
        **kwargs,
    ):
        """Nemotron-H's `generate` from the embedded prompt (the media enter once, in prefill)."""
        embeds = self.embed(
            input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
        )
        return self.language_model.generate(
            input_ids=input_ids, inputs_embeds=embeds, attention_mask=attention_mask, **kwargs
        )


def register() -> None:
    """Make transformers' Auto classes know the Omni checkpoint (idempotent), and give
    `NemotronHLanguageModel` Nemotron-H's checkpoint renaming (`backbone.` <-> `model.`):
    transformers skips the renaming of a subclass defined outside it unless it is registered."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    register_checkpoint_conversion_mapping(
        NemotronHLanguageModel.__name__,
        get_checkpoint_conversion_mapping("nemotron_h"),
        overwrite=True,
    )
    try:
        AutoConfig.register(MODEL_TYPE, NemotronOmniConfig)
        AutoModelForCausalLM.register(NemotronOmniConfig, NemotronH_Nano_Omni_Reasoning_V3)
    except ValueError:  # already registered in this process
        pass


register()
