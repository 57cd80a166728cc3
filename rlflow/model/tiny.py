"""A tiny random Qwen2.5-VL checkpoint, built entirely in code (no hub downloads).

It is a real HF checkpoint directory (config.json, model.safetensors, tokenizer, image and video
processor configs, chat template), so tests and the CPU recipe load it through exactly the path a
real Qwen2.5-VL checkpoint takes. Sizes respect vLLM's CPU attention (head_dim >= 32).

The tokenizer is a byte-level BPE trained on a small corpus of the synthetic tasks' words, with
Qwen2-VL's special tokens and chat template, and `<answer>`/`</answer>` as single tokens so a
tiny policy can learn the answer format quickly; `<tool_call>`/`</tool_call>` are single tokens
too, as in Qwen2.5's and Qwen3's tokenizers, so a tiny policy can learn to call a tool.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlflow.data.prompts import ANSWER_CLOSE, ANSWER_OPEN
from rlflow.model.presets import QWEN25VL_PRESET_NAMES

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
ANSWER_TOKENS = [ANSWER_OPEN, ANSWER_CLOSE]  # one token each (format: rlflow.data.prompts)
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # one token each (rlflow.serve.tools' tags)

# Qwen2-VL-Instruct's chat template (same semantics), so prompts look like the real model's; with
# Qwen2.5's hermes tool blocks (the request's tools in the system turn, the assistant's calls in
# <tool_call> tags, tool results in <tool_response> tags), which render only when a conversation
# has tools, calls or tool turns.
_TOOLS_SYSTEM = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n' }}{{ '\\n' }}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
)
_TOOL_TURN = (
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
)
_TOOL_CALLS = (
    "{% for call in message['tool_calls'] or [] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    '{{ \'\\n\' }}<tool_call>\n{"name": "{{ call[\'name\'] }}", "arguments": '
    "{{ call['arguments'] | tojson }}}\n</tool_call>{% endfor %}"
)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    + _TOOLS_SYSTEM
    + "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}" + _TOOL_TURN + "{% else %}"
    "{% if loop.first and message['role'] != 'system' and not tools %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    + _TOOL_CALLS
    + "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "how many are there in the image picture video scene clip frame frames objects object shapes "
    "shape appear appeared appears first last which came before after total of and or with a an "
    "is it what count counting number answer tags tag with a number in please you helpful "
    "assistant system user red green blue yellow purple cyan gray grey orange brown white black "
    "cube cubes sphere spheres cylinder cylinders square squares circle circles triangle "
    "triangles ball balls block blocks big small large tiny the each color colour size"
).split()


@dataclass(frozen=True)
class LanguageSizes:
    """The language model's shapes of a random Qwen (a family's sizes add their own); the
    defaults are the tiny CPU models'. vocab_size is the model's (embedding rows); the tokenizer
    has tokenizer_vocab entries, like real checkpoints whose embedding is padded past it."""

    vocab_size: int = 512
    tokenizer_vocab: int = 512
    hidden: int = 128
    intermediate: int = 384
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    max_positions: int = 4096  # max_position_embeddings (the dry run bounds prompt + generation)


@dataclass(frozen=True)
class ModelSizes(LanguageSizes):
    """Shapes of a random Qwen2.5-VL. head_dim = hidden / heads must be >= 32 for vLLM's CPU
    attention."""

    vision_depth: int = 2
    vision_hidden: int = 64
    vision_intermediate: int = 128
    vision_heads: int = 2
    vision_full_attention: tuple[int, ...] = (1,)


# A preset: the language model's shapes, then the vision tower's, a few to a line.
# fmt: off
PRESETS = {
    "tiny": ModelSizes(),
    # Qwen2.5-VL-3B's shapes (3.75 B parameters), for GPU benchmarks with random weights
    "qwen25vl-3b": ModelSizes(
        vocab_size=151936, hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2,
        tie_embeddings=True, rope_theta=1000000.0, max_positions=128000,
        vision_depth=32, vision_hidden=1280, vision_intermediate=3420, vision_heads=16,
        vision_full_attention=(7, 15, 23, 31),
    ),
}
# fmt: on
TEXT_TINY = replace(PRESETS["tiny"], layers=2)  # the text-only builtin (tiny-qwen3)
assert tuple(PRESETS) == QWEN25VL_PRESET_NAMES, "rlflow/model/presets.py lists the CLI's presets"


def mrope_text_config(sizes: ModelSizes, ids: dict[str, int], tokens: int, tie: bool) -> dict:
    """The language model's part of a Qwen-VL config (Qwen2-VL and Qwen2.5-VL share it)."""
    half = sizes.hidden // sizes.heads // 2  # mrope sections (temporal, height, width) sum to this
    return dict(
        **language_config(sizes, tokens),
        max_position_embeddings=sizes.max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": sizes.rope_theta,
            "mrope_section": [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8],
        },
        **token_ids_config(ids),
        tie_word_embeddings=tie,
    )


def vision_config(sizes, *, patch_size: int, **family_keys) -> dict:
    """The vision tower's part of a Qwen2.5-VL or Qwen3-VL config at `sizes` (the tower's
    vision_* fields): `patch_size`-pixel patches, merged 2 x 2, two frames to a temporal patch,
    the merger's output as wide as the language model; `family_keys`: the family's own."""
    return dict(
        depth=sizes.vision_depth,
        hidden_size=sizes.vision_hidden,
        intermediate_size=sizes.vision_intermediate,
        num_heads=sizes.vision_heads,
        in_channels=3,
        patch_size=patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=sizes.hidden,
        **family_keys,
    )


def language_config(sizes: LanguageSizes, tokens: int) -> dict:
    """A language model's sizes in an HF config's keys (`tokens`: the tokenizer's length, a
    floor for the vocabulary)."""
    return dict(
        vocab_size=max(sizes.vocab_size, tokens),
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
    )


def token_ids_config(ids: dict[str, int]) -> dict:
    """A config's bos, eos and pad token ids from the tiny tokenizer's special tokens."""
    return dict(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def media_token_config(ids: dict[str, int]) -> dict:
    """A Qwen-VL config's media placeholder token ids."""
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def write_tiny_checkpoint(
    out_dir: str | Path,
    *,
    seed: int,  # model.tiny_seed for builtin: checkpoints
    lm_head_scale: float = 1.0,
    sizes: ModelSizes = PRESETS["tiny"],
    device: str = "cpu",
) -> Path:
    """Write a tiny random Qwen2.5-VL checkpoint to `out_dir` (created); bit-reproducible per seed.

    lm_head_scale > 1 widens the random logits (fewer near-ties): parity tests use it so greedy
    decoding is not decided by rounding noise between two equal tokens.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    def config(ids: dict[str, int], tokens: int):
        return Qwen2_5_VLConfig(
            text_config=mrope_text_config(sizes, ids, tokens, sizes.tie_embeddings),
            vision_config=vision_config(
                sizes,
                patch_size=14,
                window_size=112,
                fullatt_block_indexes=list(sizes.vision_full_attention),
                tokens_per_second=2,
            ),
            **media_token_config(ids),
            tie_word_embeddings=sizes.tie_embeddings,
        )

    tiny = TinyModel(Qwen2_5_VLForConditionalGeneration, config, save_processor=save_processor)
    out = write_tiny(out_dir, tiny, sizes, seed=seed, device=device, lm_head_scale=lm_head_scale)
    (out / "rlflow_tiny.json").write_text(
        json.dumps({"seed": seed, "lm_head_scale": lm_head_scale, **sizes.__dict__}, indent=2)
    )
    return out


def write_tiny_text_checkpoint(
    out_dir: str | Path, *, family: str = "qwen3", seed: int, lm_head_scale: float = 1.0
) -> Path:
    """A tiny random text-only Qwen2 or Qwen3 checkpoint (Qwen3: per-head query/key RMSNorm),
    with the same locally built tokenizer and chat template as the vision-language one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    if family not in classes:
        raise ValueError(f"family must be one of {sorted(classes)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = TEXT_TINY
    tokenizer = build_tokenizer(sizes.tokenizer_vocab, seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config_cls, model_cls = classes[family]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        head_dim=sizes.hidden // sizes.heads,
        max_position_embeddings=sizes.max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **token_ids_config(ids),
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model.generation_config = GenerationConfig(
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _corpus(seed: int, lines: int = 3000):
    rng = random.Random(seed)
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.5:
            words.insert(rng.randrange(len(words) + 1), str(rng.randint(0, 12)))
        text = " ".join(words)
        yield text.capitalize() + rng.choice(["?", ".", ""]) if rng.random() < 0.5 else text


def build_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ANSWER_TOKENS) - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
    # normal (not special) tokens: kept when decoding; the tool tags first, so the answer tags
    # keep the ids they had before the tool tags were added
    fast.add_tokens(TOOL_TOKENS)
    fast.add_tokens(ANSWER_TOKENS)
    fast.padding_side = "left"
    return fast


def save_processor(out: Path, tokenizer, processor_cls=None) -> None:
    """The tiny image and video processors (Qwen2-VL's, shared by the Qwen-VL families), saved
    with the tokenizer and chat template as `processor_cls` (default: Qwen2.5-VL's processor)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    # 56x56 (one merged token) .. 224x224 pixels per image; a 112x112 image gives 16 tokens.
    image_processor = Qwen2VLImageProcessor(
        min_pixels=56 * 56, max_pixels=224 * 224, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=56 * 56,
        max_pixels=224 * 224 * 4,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        do_sample_frames=False,
    )
    processor = (processor_cls or Qwen2_5_VLProcessor)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)


# --- the writer every family's tiny checkpoint goes through ------------------------------------


@dataclass(frozen=True)
class TinyModel:
    """What a family's tiny checkpoint is, for `write_tiny`: its HF class; `config(ids, tokens)`,
    its HF config from the special token ids and the tokenizer's length; whether the generation
    config names bos; `init(model)`, weights it draws itself (e.g. a wider router); and
    `save_processor(out, tokenizer)`, its processors (default: the tokenizer alone)."""

    model_class: type
    config: Callable[[dict[str, int], int], Any]
    bos: bool = True
    init: Callable[[Any], None] | None = None
    save_processor: Callable[[Path, Any], None] | None = None


def write_tiny(
    out_dir: str | Path,
    tiny: TinyModel,
    sizes: LanguageSizes,
    *,
    seed: int,
    device: str,
    lm_head_scale: float,
) -> Path:
    """Write a random HF checkpoint to `out_dir` (created): the tiny checkpoint writer every
    family shares, so a family keeps only its sizes and its `TinyModel`.

    The tokenizer is rlflow's locally built one (`build_tokenizer`) with `sizes.tokenizer_vocab`
    entries. The weights are made on `device` (fp32 on the CPU, bf16 elsewhere: a real-shaped
    model initialises in seconds on a GPU) from `seed`, then `tiny.init` changes them, and an
    untied lm_head is scaled by `lm_head_scale` (> 1: fewer near-ties in greedy decoding). The
    generation config names pad and eos (and bos with `tiny.bos`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(sizes.tokenizer_vocab, seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    hf_config = tiny.config(ids, len(tokenizer))
    torch.manual_seed(seed)
    with torch.device(device):
        model = tiny.model_class._from_config(
            hf_config, dtype=torch.float32 if device == "cpu" else torch.bfloat16
        ).eval()
    with torch.no_grad():
        if tiny.init is not None:
            tiny.init(model)
        if lm_head_scale != 1.0 and not hf_config.tie_word_embeddings:
            model.lm_head.weight.mul_(lm_head_scale)
    model.generation_config = GenerationConfig(
        **({"bos_token_id": ids["<|endoftext|>"]} if tiny.bos else {}),
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    if tiny.save_processor is None:
        tokenizer.save_pretrained(out)
    else:
        tiny.save_processor(out, tokenizer)
    return out
