"""HF checkpoint -> Megatron policy through megatron-bridge, and back (HF-named weights).

The policy is megatron-bridge's `Qwen25VLModel` (HF vision tower + megatron-core GPT language
model, local layer spec: no Transformer Engine needed), split by the tensor/pipeline sizes that
`rlflow.parallel` set up. The same path loads the built-in tiny model and a real checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe.schema import ModelConfig, ParallelismConfig

BUILTIN_PREFIX = "builtin:"
BUILTINS = ("tiny-qwen25vl", "tiny-qwen3")  # tiny-qwen3: text-only
VISION_LANGUAGE_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
TEXT_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ARCHITECTURES = VISION_LANGUAGE_ARCHITECTURES + TEXT_ARCHITECTURES


@dataclass(frozen=True)
class MediaTokens:
    """The model's media placeholder ids; -1 (never a token) for text-only models."""

    image: int
    video: int
    merge_size: int  # visual embeddings per pad token = patches / merge_size**2

    @staticmethod
    def of(hf_config) -> MediaTokens:
        vision = getattr(hf_config, "vision_config", None)
        if vision is None:
            return MediaTokens(-1, -1, 1)
        return MediaTokens(
            hf_config.image_token_id, hf_config.video_token_id, vision.spatial_merge_size
        )


@dataclass
class Policy:
    """A Megatron model plus what generation and export need to know about it."""

    chunks: list  # megatron model chunks as built (DDP / Float16Module wrapped when trainable)
    bridge: Any  # megatron.bridge.AutoBridge, for HF <-> Megatron weight conversion
    hf_config: Any  # transformers config of the checkpoint
    checkpoint: Path
    dtype: torch.dtype
    trainable: bool
    extra: dict = field(default_factory=dict)

    @property
    def core(self):
        """The unwrapped Qwen25VLModel (no DDP, no Float16Module)."""
        return _unwrap(self.chunks[0])

    @property
    def is_multimodal(self) -> bool:
        return getattr(self.hf_config, "vision_config", None) is not None

    @property
    def media_tokens(self) -> MediaTokens:
        return MediaTokens.of(self.hf_config)

    @property
    def image_token_id(self) -> int:
        return self.media_tokens.image

    @property
    def video_token_id(self) -> int:
        return self.media_tokens.video


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def resolve_checkpoint(model_cfg: ModelConfig, cache_dir: Path) -> Path:
    """The checkpoint directory: a user path, or a built-in tiny model written under cache_dir.

    Built-ins are written by global rank 0 into a temp dir and renamed (atomic); other ranks wait.
    """
    spec = model_cfg.checkpoint
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        if name not in BUILTINS:
            raise RlflowError(
                Diagnostic(
                    "model.unknown-builtin",
                    f"`model.checkpoint` names unknown built-in model `{name}`",
                    help="built-in models: " + ", ".join(BUILTIN_PREFIX + b for b in BUILTINS),
                )
            )
        target = cache_dir / f"{name}-seed{model_cfg.tiny_seed}"
        _write_builtin_once(target, name, model_cfg.tiny_seed)
        return target
    path = Path(spec).expanduser()
    config = path / "config.json"
    if not config.is_file():
        raise RlflowError(
            Diagnostic(
                "model.not-found",
                f"`model.checkpoint` is `{spec}`, which has no config.json",
                help="point model.checkpoint at an HF checkpoint directory (config.json, *.safetensors, "
                "tokenizer and processor files), or use builtin:tiny-qwen25vl",
            )
        )
    architectures = json.loads(config.read_text()).get("architectures") or []
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        raise RlflowError(
            Diagnostic(
                "model.unsupported",
                f"checkpoint `{spec}` is {architectures}, which rlflow does not train yet",
                help="supported architectures: " + ", ".join(SUPPORTED_ARCHITECTURES),
            )
        )
    return path


def _write_builtin_once(target: Path, name: str, seed: int) -> None:
    import torch.distributed as dist

    from rlflow.model.tiny import write_tiny_checkpoint, write_tiny_text_checkpoint

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (target / "config.json").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        if name == "tiny-qwen3":
            write_tiny_text_checkpoint(tmp, family="qwen3", seed=seed)
        else:
            write_tiny_checkpoint(tmp, seed=seed)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)
    if dist.is_initialized():
        dist.barrier()


def load_policy(
    checkpoint: Path, model_cfg: ModelConfig, parallel_cfg: ParallelismConfig, trainable: bool
) -> Policy:
    """Build the Megatron model for this rank and load the HF weights into it."""
    from rlflow.model import cpu_compat, library_logs, te_guard

    library_logs.quiet()
    te_guard.install()
    cpu_compat.enable()
    from megatron.bridge import AutoBridge

    library_logs.restore_root()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    bridge = AutoBridge.from_hf_pretrained(str(checkpoint))
    hf_config = bridge.hf_pretrained.config
    provider = bridge.to_megatron_provider(load_weights=True)
    dtype = torch.bfloat16 if model_cfg.dtype == "bfloat16" else torch.float32
    _configure_provider(provider, hf_config, model_cfg, parallel_cfg, dtype)
    provider.finalize()
    chunks = provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=cpu_compat.needs_compat(),
        bf16=dtype == torch.bfloat16,
        fp16=False,
    )
    if trainable:
        # Wrapped here rather than by the bridge, whose wrapper insists on CUDA streams.
        # Grads are reduced in fp32, without overlap: rlflow's steps are short; this stays simple.
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        chunks = [
            DistributedDataParallel(_unwrap(chunk).config, ddp_config, chunk) for chunk in chunks
        ]
    from rlflow.model import packed_attention, vision_attention
    from rlflow.model.forward import language_model
    from rlflow.model.vision_cache import VisionCache

    for chunk in chunks:
        if getattr(_unwrap(chunk), "visual", None) is not None:
            vision_attention.install(_unwrap(chunk).visual)
        packed_attention.install(language_model(_unwrap(chunk)))
        chunk.train(trainable)
        if not trainable:
            for param in chunk.parameters():
                param.requires_grad_(False)
    policy = Policy(
        chunks=chunks,
        bridge=bridge,
        hf_config=hf_config,
        checkpoint=checkpoint,
        dtype=dtype,
        trainable=trainable,
    )
    policy.extra["provider"] = provider
    # Vision features recomputed on every use; the trainer swaps in one shared, per-step cache
    # when the tower is frozen (rlflow.train.setup).
    policy.extra["vision_cache"] = VisionCache(enabled=False)
    return policy


def _configure_provider(
    provider, hf_config, model_cfg: ModelConfig, parallel_cfg: ParallelismConfig, dtype: torch.dtype
) -> None:
    from megatron.bridge.models.gpt_provider import local_layer_spec

    # Always the local (non-TE) spec: identical numerics on CPU and GPU, and rlflow's generation
    # decoder (rlflow/generation/decoder.py) reads this spec's weights directly.
    provider.transformer_layer_spec = local_layer_spec
    multimodal = getattr(hf_config, "vision_config", None) is not None
    if multimodal:
        # megatron-bridge 0.6.2 keeps its default [16, 24, 24] instead of reading the checkpoint's.
        provider.mrope_section = list(_mrope_section(hf_config))
    provider.tensor_model_parallel_size = parallel_cfg.tensor_parallel_size
    provider.pipeline_model_parallel_size = parallel_cfg.pipeline_parallel_size
    provider.context_parallel_size = parallel_cfg.context_parallel_size
    provider.expert_model_parallel_size = parallel_cfg.expert_parallel_size
    provider.sequence_parallel = False
    provider.params_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = False
    provider.pipeline_dtype = dtype
    provider.autocast_dtype = dtype
    provider.attention_dropout = 0.0
    provider.hidden_dropout = 0.0
    # Without apex/TE's compiled kernels the fused paths crash (bf16 prompts whose length is a
    # multiple of 4 select scaled_upper_triang_masked_softmax_cuda) or are unavailable.
    provider.masked_softmax_fusion = False
    provider.gradient_accumulation_fusion = False
    provider.bias_activation_fusion = False
    provider.bias_dropout_fusion = False
    provider.apply_rope_fusion = False
    provider.persist_layer_norm = False
    provider.cross_entropy_loss_fusion = False
    if multimodal:
        provider.freeze_vision_model = model_cfg.freeze_vision
        provider.freeze_vision_projection = model_cfg.freeze_vision
        provider.freeze_language_model = False


def _mrope_section(hf_config) -> list[int]:
    text = getattr(hf_config, "text_config", hf_config)
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(text, attr, None) or {}
        if "mrope_section" in params:
            return params["mrope_section"]
    raise RlflowError(
        Diagnostic(
            "model.mrope",
            "the checkpoint's config has no mrope_section",
            help="Qwen2.5-VL configs set text_config.rope_parameters.mrope_section",
        )
    )


def export_hf_state_dict(policy: Policy) -> dict[str, torch.Tensor]:
    """Megatron weights -> HF checkpoint names (full tensors on every rank, on CPU)."""
    return {
        name: tensor.detach().cpu()
        for name, tensor in policy.bridge.export_hf_weights(
            policy.chunks, cpu=True, show_progress=False
        )
    }


def copy_weights(src: Policy, dst: Policy) -> None:
    """Copy parameter values between two Megatron builds of the same model on this rank."""
    src_params = dict(src.core.named_parameters())
    with torch.no_grad():
        for name, param in dst.core.named_parameters():
            param.copy_(src_params[name].to(param.dtype))
