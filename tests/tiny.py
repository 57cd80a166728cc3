"""Shared helpers for tests that need the tiny model: checkpoint, policy, prompts of each media kind."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

from rlflow.recipe.schema import ModelConfig, ParallelismConfig

TINY_CPU_RECIPE = (
    Path(__file__).resolve().parents[1] / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
)
BASE_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "base.yaml"
SINGLE = ParallelismConfig(1, 1, 1, 1, "off")


def _base_model() -> ModelConfig:
    """recipes/base.yaml's model section (its defaults, e.g. `model.moe`, stated once)."""
    from rlflow.recipe.load import load_recipe

    return load_recipe(BASE_RECIPE).recipe.model


FP32 = dataclasses.replace(
    _base_model(), checkpoint="unused", dtype="float32", freeze_vision=True, tiny_seed=0
)


@functools.cache
def base_recipe():
    """recipes/base.yaml, loaded: where code takes a recipe key, tests pass the recipe's value
    (rlflow has no keyword defaults for recipe keys)."""
    from rlflow.recipe.load import load_recipe

    return load_recipe(BASE_RECIPE).recipe


def init_single_rank(seed: int = 1):
    """torch.distributed (gloo, world 1) + megatron parallel state, with base.yaml's timeout."""
    return init_layout(SINGLE, seed)


def init_layout(layout: ParallelismConfig, seed: int = 1):
    """torch.distributed + megatron parallel state of `layout`, with base.yaml's timeout."""
    from rlflow import parallel

    timeout_s = base_recipe().watchdog.collective_timeout_s
    return parallel.init_parallel(layout, seed=seed, timeout_s=timeout_s, placement=None)


def spawned_rank(rank: int, world: int, port: int) -> None:
    """First thing in a rank that torch.multiprocessing started: its torch.distributed
    environment (`world` ranks on this machine, meeting at `port`), one CPU thread, quiet
    library logs. `init_layout` then joins the ranks."""
    import os

    import torch

    from rlflow.compat import library_logs

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    library_logs.quiet()


def megatron_generation(policy, pad_token_id: int, **changes):
    """MegatronGeneration with base.yaml's generation knobs; `changes` for the ones a test is about."""
    from rlflow.generation.megatron.engine import MegatronGeneration

    gen = base_recipe().generation
    knobs = {
        "max_batch_size": gen.max_batch_size,
        "cuda_graphs": gen.cuda_graphs,
        "compile_decode": gen.compile_decode,
        "share_prompts": gen.share_prompts,
        "fp8": gen.fp8,
        "release_cache": gen.release_cache,
        "cache_tokens": gen.kv_cache_tokens,
    }
    return MegatronGeneration(policy, pad_token_id, **{**knobs, **changes})


@functools.cache
def tiny_checkpoint(root: str, lm_head_scale: float = 8.0) -> Path:
    """A tiny Qwen2.5-VL checkpoint; lm_head scaled so greedy decoding has no near-ties."""
    from rlflow.model.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(
        Path(root) / f"tiny-scale{lm_head_scale}", seed=0, lm_head_scale=lm_head_scale
    )


def random_image(seed: int, size: int = 112):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def text_prompt(tokenizer, question: str, sample_id: str = "text"):
    """A text-only Prompt through the tokenizer's chat template (a text model's, no processor)."""
    from rlflow.generation.base import Prompt
    from rlflow.model.media import Media

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return Prompt(sample_id, question, tuple(ids), Media())


# Text questions of different lengths: the hybrid and MoE model and engine tests' batch
QUESTIONS = [
    "How many red squares are there?",
    "Count.",
    "A picture shows a large blue triangle and a small red circle. How many circles?",
]


def frozen_policy(path):
    """(policy, tokenizer) of a checkpoint: its frozen Megatron policy (fp32, one rank; call it
    under the `single_rank` fixture) and its tokenizer."""
    from transformers import AutoTokenizer

    from rlflow.model.build import load_policy

    policy = load_policy(path, FP32, SINGLE, trainable=False)
    return policy, AutoTokenizer.from_pretrained(str(path))


def policy_and_hf(path, hf_class):
    """(policy, tokenizer, hf, rows) of a text checkpoint: `frozen_policy`'s two, HF's model
    (`hf_class`, fp32, eval) and QUESTIONS' chat-template token ids."""
    import torch

    policy, tokenizer = frozen_policy(path)
    hf = hf_class.from_pretrained(str(path), dtype=torch.float32).eval()
    rows = [list(text_prompt(tokenizer, q).token_ids) for q in QUESTIONS]
    return policy, tokenizer, hf, rows


def text_prompts(tokenizer) -> list:
    """QUESTIONS as text-only Prompts (sample ids text-0, text-1, text-2)."""
    return [text_prompt(tokenizer, q, f"text-{i}") for i, q in enumerate(QUESTIONS)]


def full_forward_greedy_equals_hf(policy, hf, row, n: int, pad: int) -> None:
    """Asserts the policy's `n` greedy tokens after `row`, each from a full forward over the
    sequence so far, are HF generate's."""
    import torch

    from rlflow.model.forward import policy_logits
    from rlflow.model.media import Media

    with torch.no_grad():
        ids = torch.tensor([row])
        ref = hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=pad)
        ours = list(row)
        for _ in range(n):
            mask = torch.ones(1, len(ours), dtype=torch.bool)
            logits = policy_logits(policy.core, torch.tensor([ours]), mask, Media())
            ours.append(int(logits[0, -1].argmax()))
    assert ours[len(row) :] == ref[0, len(row) :].tolist()


def right_padded(rows, pad: int):
    """Token id rows -> ids [B, T] and mask [B, T] (bool), right-padded as the trainer's
    batches are."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    return ids, mask


def completion_rows(prompts, completions, pad: int):
    """Right-padded prompt + completion rows: ids, mask, targets [B, T - 1] (the completion's
    tokens)."""
    import torch

    sequences = [list(p.token_ids) + c.token_ids for p, c in zip(prompts, completions)]
    ids, mask = right_padded(sequences, pad)
    targets = torch.zeros(len(sequences), ids.shape[1] - 1, dtype=torch.bool)
    for i, (row, prompt) in enumerate(zip(sequences, prompts)):
        targets[i, len(prompt.token_ids) - 1 : len(row) - 1] = True
    return ids, mask, targets


def packed_logprobs(policy, ids, mask, targets):
    """The trainer's packed forward over text rows: the logprobs of the `targets` tokens."""
    from rlflow.model.media import Media
    from rlflow.model.packed_forward import pack_rows, target_logprobs

    packed = pack_rows(policy.core, ids, mask, mask, targets, [Media()] * ids.shape[0])
    return target_logprobs(policy.core, packed, (None, None), with_entropy=False)[0]


def logprobs_against_hf(policy, hf, ids, mask):
    """Right-padded text rows through the policy's padded forward, its packed forward and HF:
    asserts the padded logits are HF's (within 1e-4) at real tokens; returns the logprobs of
    every next real token, (packed trainer's, HF's, padded policy's)."""
    import torch

    from rlflow.model.forward import policy_logits
    from rlflow.model.media import Media

    targets = mask[:, 1:] & mask[:, :-1]
    with torch.no_grad():
        ours = policy_logits(policy.core, ids, mask, Media())
        ref = hf(input_ids=ids, attention_mask=mask.long()).logits
        packed_lp = packed_logprobs(policy, ids, mask, targets)
    assert (ours[mask] - ref[mask]).abs().max() < 1e-4

    def next_tokens(logits):
        return torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0][targets]

    return packed_lp, next_tokens(ref), next_tokens(ours)


def token_ids(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


def greedy_batch_equals_hf(engine, policy, tokenizer, prompts):
    """Prompts of different lengths, 2 samples of two of them (rows 0, 0, 1, 2, 2), in one
    batch: asserts each row's 64 greedy tokens are HF's for its prompt and its logprobs HF's.
    Returns (rows, the engine's completions)."""
    from rlflow.generation.hf import HFGeneration

    params = greedy(64, tokenizer.eos_token_id)
    rows = [prompts[0], prompts[0], prompts[1], prompts[2], prompts[2]]
    ours = engine.generate(rows, params)
    hf = HFGeneration(policy, tokenizer.pad_token_id, 8).generate(prompts, params)
    ref = [hf[0], hf[0], hf[1], hf[2], hf[2]]
    assert token_ids(ours) == token_ids(ref)
    assert all(len(c.token_ids) == 64 for c in ours)
    for a, b in zip(ours, ref):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    return rows, ours


def prefill_sharing_changes_nothing(make_engine, prompts, *, routing: bool = False) -> None:
    """T=1 sampling (a row's draws depend on its seed only), 3 samples of prompts[2] and 2 of
    prompts[1]: asserts that sharing each prompt's prefill equals prefilling every row alone,
    and that a cache so small (3 blocks of 64 tokens) that the rows run in several passes, some
    preempted mid-generation, changes no row's tokens or logprobs (nor, with `routing`, its
    recorded experts). `make_engine(**changes)`: the engine under test."""
    import torch

    from rlflow.generation.base import SamplingParams

    rows = [prompts[2]] * 3 + [prompts[1]] * 2
    params = SamplingParams(24, 1.0, 1.0, 0, seed=5, stop_token_ids=(-1,), ignore_eos=True)
    first = make_engine().generate(rows, params)
    shared = token_ids(first)
    assert len({tuple(t) for t in shared[:3]}) > 1  # samples, not copies
    unshared = make_engine(share_prompts=False).generate(rows, params)
    small = make_engine(cache_tokens=192)
    passes = small.generate(rows, params)
    for other in (unshared, passes):
        assert token_ids(other) == shared
        for a, b in zip(first, other):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
            if routing:
                assert torch.equal(a.routing, b.routing)
    assert small.last_timings["passes"] > 1 and small.last_timings["preempted"] > 0


def make_prompt(
    processor, kind: str, question: str, seed: int = 0, frames: int = 4, fps: float = 2.0
):
    """A Prompt of one media kind built with the checkpoint's own processor (expanded form)."""
    from rlflow.generation.base import Prompt
    from rlflow.model.media import Media

    content = ([{"type": kind}] if kind != "text" else []) + [{"type": "text", "text": question}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    kwargs, images, video = {}, (), None
    if kind == "image":
        images = (random_image(seed),)
        kwargs["images"] = list(images)
    if kind == "video":
        video = tuple(random_image(seed + i) for i in range(frames))
        kwargs.update(
            videos=[list(video)],
            do_sample_frames=False,
            video_metadata=[
                {
                    "fps": fps,
                    "total_num_frames": frames,
                    "frames_indices": list(range(frames)),
                    "duration": frames / fps,
                }
            ],
        )
    enc = processor(text=[text], return_tensors="pt", **kwargs)
    media = Media(
        enc.get("pixel_values"),
        enc.get("image_grid_thw"),
        enc.get("pixel_values_videos"),
        enc.get("video_grid_thw"),
        enc.get("second_per_grid_ts"),
    )
    return Prompt(
        sample_id=f"{kind}-{seed}",
        text=text,
        token_ids=tuple(enc["input_ids"][0].tolist()),
        media=media,
        images=images,
        video=video,
        video_fps=fps if video else None,
    )


def mixed_prompts(processor) -> list:
    """One batch of different lengths and media kinds: image, text-only, video, a second image."""
    return [
        make_prompt(processor, "image", "How many red squares are there?", seed=1),
        make_prompt(processor, "text", "How many?", seed=2),
        make_prompt(processor, "video", "How many objects appear in the video?", seed=3),
        make_prompt(processor, "image", "Count the circles.", seed=4),
    ]


def greedy(n: int, eos: int, ignore_eos: bool = True):
    """Greedy sampling of `n` tokens with `eos` as the stop token (ignored by default)."""
    from rlflow.generation.base import SamplingParams

    return SamplingParams(
        max_new_tokens=n,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=0,
        stop_token_ids=(eos,),
        ignore_eos=ignore_eos,
    )


def left_padded(prompts, pad_token_id: int):
    """Prompt ids [B, T] and attention mask [B, T] (long), left-padded as HF's generate pads."""
    import torch

    width = max(len(p.token_ids) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id)
    mask = torch.zeros(ids.shape, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
        mask[i, width - len(p.token_ids) :] = 1
    return ids, mask


def hf_logits_gap(hf, policy, prompts, pad_token_id: int) -> float:
    """Max |logits| difference, at real tokens, between the HF model and the Megatron policy on
    a left-padded batch of prompts (the family supplies HF's extra inputs)."""
    import torch

    from rlflow.model.forward import policy_logits
    from rlflow.model.media import Media

    ids, mask = left_padded(prompts, pad_token_id)
    media = Media.concat([p.media for p in prompts])
    extra = policy.family.hf_generate_inputs(ids, policy.media_tokens)
    with torch.no_grad():
        ref = hf(
            input_ids=ids,
            attention_mask=mask,
            **extra,
            **{k: v for k, v in vars(media).items() if v is not None},
        ).logits
        ours = policy_logits(policy.core, ids, mask.bool(), media)
    valid = mask.bool()
    assert ours.shape == ref.shape
    return float((ours[valid] - ref[valid]).abs().max())


def recipe_update(policy, batch, recipe, *, old_logprobs, ref_logprobs, batching, minibatches=1):
    """`grpo_update` of `batch` with a fresh optimizer and the loss from the recipe's keys."""
    from rlflow.train.update import Optimizer, grpo_update

    return grpo_update(
        policy,
        Optimizer.from_config(policy, recipe.optimizer),
        batch,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        loss_cfg=recipe.loss,
        batching=batching,
        num_minibatches=minibatches,
    )
