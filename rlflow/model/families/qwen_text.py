"""Text-only Qwen2 and Qwen3: megatron-core GPT with 1-D RoPE (Qwen3: per-head q/k RMSNorm).

megatron-bridge converts both natively; the generation decoder reads Qwen3's q/k norms from the
policy's layers. No media: prompts are the tokenizer's chat template only.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.model.family import ModelFamily


class QwenText(ModelFamily):
    model_types = ("qwen2", "qwen3")
    architectures = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    builtins = ("tiny-qwen3",)
    multimodal = False
    rope = "1d"

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        from rlflow.model.tiny import write_tiny_text_checkpoint

        family = name.removeprefix("tiny-")
        return write_tiny_text_checkpoint(
            out_dir, family=family, seed=seed, lm_head_scale=lm_head_scale
        )

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.shape import builtin_keys
        from rlflow.model.tiny import TEXT_TINY

        return builtin_keys(TEXT_TINY, max_positions=TEXT_TINY.max_positions, multimodal=False)


FAMILY = QwenText()
