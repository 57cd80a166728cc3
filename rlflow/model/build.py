"""HF checkpoint -> Megatron policy through megatron-bridge, and back (HF-named weights).

The checkpoint's model family (rlflow/model/family.py) says how: megatron-bridge builds the
model (e.g. `Qwen25VLModel`: HF vision tower + megatron-core GPT language model) with the local
layer spec (no Transformer Engine needed), split by the tensor/pipeline sizes that
`rlflow.parallel` set up. The same path loads the built-in tiny models and a real checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlflow.errors import Diagnostic, RlflowError
from rlflow.model import family as families
from rlflow.model.family import MediaTokens, ModelFamily
from rlflow.model.media import Prompt
from rlflow.model.vision_cache import VisionCache
from rlflow.recipe.schema import ModelConfig, ParallelismConfig

BUILTIN_PREFIX = families.BUILTIN_PREFIX


@dataclass
class Policy:
    """A Megatron model plus what generation and export need to know about it."""

    chunks: list  # megatron model chunks as built (DDP / Float16Module wrapped when trainable)
    bridge: Any  # megatron.bridge.AutoBridge, for HF <-> Megatron weight conversion
    hf_config: Any  # transformers config of the checkpoint
    family: ModelFamily
    checkpoint: Path
    dtype: torch.dtype
    trainable: bool
    # Vision features, recomputed on every use unless the trainer shares one per-step cache
    # between the policy and the reference (frozen tower: rlflow.train.setup.share_vision_cache).
    vision_cache: VisionCache
    # MoE: this step's routing statistics of the trainer's forwards (rlflow.model.moe.routing.Stats;
    # step_metrics reads and resets them)
    routing_stats: Any = None

    @property
    def core(self):
        """The unwrapped model, e.g. Qwen25VLModel (no DDP, no Float16Module)."""
        return _unwrap(self.chunks[0])

    @property
    def is_multimodal(self) -> bool:
        return self.family.multimodal

    @property
    def media_tokens(self) -> MediaTokens:
        return self.family.media_tokens(self.hf_config)

    @property
    def device(self) -> torch.device:
        """This rank's device (rlflow.parallel placed the model there)."""
        from rlflow import parallel

        return parallel.info().device

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids as the model consumes them, checked against its media."""
        return self.family.prompt_ids(prompt, self.media_tokens)


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
        unknown = families.unknown_builtin(spec)  # the recipe checks ran it already
        if unknown is not None:
            raise RlflowError(unknown)
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
    families.of_checkpoint(path)  # raises `model.unsupported`, naming the supported ones
    return path


def _write_builtin_once(target: Path, name: str, seed: int) -> None:
    """Write the built-in model once. A damaged copy (a run killed mid-write long ago, a disk
    error) is set aside and written again: it is derived data (name and seed), like a damaged
    checkpoint, which is reported and skipped. Rank 0 of this rank's world writes it; with
    separate placement, the generation ranks' world has a rank 0 too, and whichever renames
    second finds the same files in place."""
    import shutil

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    damage = _builtin_damage(target) if rank == 0 else None
    if damage is not None and target.exists():
        aside = target.with_name(f"{target.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(target, aside)
        print(
            f"rlflow: the built-in model {target} was damaged ({damage}); set it aside as "
            f"{aside.name} and writing it again",
            file=sys.stderr,
            flush=True,
        )
    if damage is not None:
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        families.by_builtin(name).write_tiny(tmp, name, seed=seed)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # the other world's copy won
    if dist.is_initialized():
        dist.barrier()


def _builtin_damage(target: Path) -> str | None:
    """Why the built-in model at `target` cannot be used (no config.json, a JSON file that does
    not parse), or None."""
    if not (target / "config.json").is_file():
        return "config.json is missing"
    for path in sorted(target.glob("*.json")):
        try:
            if not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
                return f"{path.name} is not a JSON object"
        except (OSError, ValueError) as exc:
            return f"{path.name}: {exc}"
    return None


def load_policy(
    checkpoint: Path, model_cfg: ModelConfig, parallel_cfg: ParallelismConfig, trainable: bool
) -> Policy:
    """Build the Megatron model for this rank and load the HF weights into it."""
    from rlflow.compat import cpu_compat, library_logs, te_guard

    library_logs.quiet()
    te_guard.install()
    cpu_compat.enable()
    from megatron.bridge import AutoBridge

    library_logs.restore_root()
    library_logs.quiet_loading()
    start = time.perf_counter()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    family = families.of_checkpoint(checkpoint)
    family.register_bridge()
    bridge = AutoBridge.from_hf_pretrained(str(checkpoint))
    hf_config = bridge.hf_pretrained.config
    provider = bridge.to_megatron_provider(load_weights=True)
    dtype = torch.bfloat16 if model_cfg.dtype == "bfloat16" else torch.float32
    _configure_provider(provider, parallel_cfg, dtype)
    family.configure_provider(provider, hf_config, model_cfg)
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
    from rlflow.model import packed_attention, sequence_parallel
    from rlflow.model.forward import language_model

    for chunk in chunks:
        core = _unwrap(chunk)
        core.rlflow_family = family  # forward, packing and generation ask it (family.of_core)
        family.install(core)
        packed_attention.install(language_model(core))
        sequence_parallel.install(language_model(core))
        chunk.train(trainable)
        if not trainable:
            for param in chunk.parameters():
                param.requires_grad_(False)
    if trainable and _is_first_rank():  # the reference model loads the same weights
        params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        print(
            f"model: loaded {checkpoint} ({params:,} parameters on rank 0, {model_cfg.dtype}) "
            f"in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
    policy = Policy(
        chunks=chunks,
        bridge=bridge,
        hf_config=hf_config,
        family=family,
        checkpoint=checkpoint,
        dtype=dtype,
        trainable=trainable,
        vision_cache=VisionCache(enabled=False),
    )
    return policy


def _is_first_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _configure_provider(provider, parallel_cfg: ParallelismConfig, dtype: torch.dtype) -> None:
    """Settings every family shares (the family adds its own: `ModelFamily.configure_provider`)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    from rlflow import parallel
    from rlflow.model import sequence_parallel

    # Always the local (non-TE) spec: identical numerics on CPU and GPU, and rlflow's generation
    # decoder (rlflow/generation/megatron/decoder.py) reads this spec's weights directly.
    provider.transformer_layer_spec = local_layer_spec
    provider.tensor_model_parallel_size = parallel_cfg.tensor_parallel_size
    provider.pipeline_model_parallel_size = parallel_cfg.pipeline_parallel_size
    provider.context_parallel_size = parallel_cfg.context_parallel_size
    provider.expert_model_parallel_size = parallel_cfg.expert_parallel_size
    provider.sequence_parallel = parallel.sequence_parallel(parallel_cfg)
    if provider.sequence_parallel:
        sequence_parallel.allow_torch_norms()
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
