"""Multi-turn trajectories in the trainer: environment tokens (loss mask 0) are context, never
targets, through a real packed update on the tiny megatron-core model; and the tool-using
recipe trains through the `rlflow` console script.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.data.scene import SceneSpec
from rlflow.data.text import make_text_row
from rlflow.environment.tool_scenes import ToolScenes
from rlflow.model.processor import PromptEncoder
from rlflow.train.rollout_dump import dump_row
from rlflow.train.rollouts import build_train_batch
from rlflow.train.update import Batching, Optimizer, grpo_update, rollout_logprobs
from tests.tiny import FP32, SINGLE, base_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-qwen3-text-tools-1n1g-cpu.yaml"
SUFFIX = " Call count, then answer in <answer></answer> tags."


@pytest.fixture(scope="module")
def trainable(single_rank, tiny_ckpt):
    from rlflow.model.build import load_policy

    return load_policy(tiny_ckpt, FP32, SINGLE, trainable=True)


def trajectories(encoder, n: int):
    """n reference trajectories of the tool task (call, tool result, answer), 2 per prompt."""
    rng = random.Random(5)
    spec = SceneSpec(image_size=56, max_objects=3, num_frames=None, condition=None)
    samples = [make_text_row(rng, f"row{i}", spec) for i in range(n // 2)]
    env = ToolScenes(encoder, 2, SUFFIX, 60, "hermes")
    prompts = [encoder.encode(s) for s in samples for _ in range(2)]
    completions = [
        env.reference(s, p) for s, p in zip([s for s in samples for _ in range(2)], prompts)
    ]
    return prompts, completions


def test_environment_tokens_are_context_never_targets(trainable, tiny_ckpt, tmp_path):
    encoder = PromptEncoder(
        tiny_ckpt, dataclasses.replace(base_recipe().data, prompt_suffix=SUFFIX)
    )
    prompts, completions = trajectories(encoder, 4)
    # the generator's logprobs: the policy's turns -0.3; the environment's tokens 0.0 (unread)
    completions = [
        dataclasses.replace(c, logprobs=[-0.3 if m else 0.0 for m in c.loss_mask])
        for c in completions
    ]
    advantages = [1.0, -1.0, 0.5, -0.5]
    build = dict(prompt_ids=trainable.prompt_ids, pad_token_id=encoder.pad_token_id)
    batch = build_train_batch(prompts, completions, advantages, **build)
    for i, (prompt, c) in enumerate(zip(prompts, completions)):
        start = len(trainable.prompt_ids(prompt)) - 1  # target index of the first response token
        got = batch.target_mask[i, start : start + len(c.token_ids)].int().tolist()
        assert got == c.loss_mask and not batch.target_mask[i, :start].any()
    env_targets = batch.attention_mask[:, 1:] & ~batch.prompt_mask[:, 1:] & ~batch.target_mask
    assert env_targets.sum() == sum(len(c.loss_mask) - sum(c.loss_mask) for c in completions) > 0

    packed = Batching(8, 0, True)
    logprobs, _ = rollout_logprobs(
        trainable, batch, packed, with_entropy=False, router_replay=False
    )
    assert (logprobs[env_targets] == 0).all()  # never computed: not a target
    assert (logprobs[batch.target_mask] < 0).all()

    # A real packed update with truncated importance sampling: nonsense generator logprobs on the
    # environment's tokens change nothing (lr 0 keeps the weights for the second update).
    recipe = base_recipe()
    loss = dataclasses.replace(
        recipe.loss,
        kl_penalty=0.0,
        importance_sampling=dataclasses.replace(recipe.loss.importance_sampling, mode="tis"),
    )
    optimizer = Optimizer.from_config(trainable, recipe.optimizer, lr=0.0)

    def update(b):
        return grpo_update(trainable, optimizer, b, old_logprobs=None, ref_logprobs=None,
                           loss_cfg=loss, batching=packed, num_minibatches=1).metrics  # fmt: skip

    clean = update(batch)
    poisoned = dataclasses.replace(
        batch, gen_logprobs=batch.gen_logprobs.masked_fill(env_targets, 40.0)
    )
    assert update(poisoned) == clean
    # trained as if every token were the policy's, the same rollouts give another loss
    everything = [dataclasses.replace(c, loss_mask=None) for c in completions]
    assert (
        update(build_train_batch(prompts, everything, advantages, **build))["loss"] != clean["loss"]
    )

    # the debug dump of the row shows the tool result's tokens with loss mask 0
    text = dump_row(tmp_path, 1, batch, encoder.tokenizer).read_text()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    masks = [line.split()[2] for line in lines]
    assert masks.count("0") == len(completions[0].loss_mask) - sum(completions[0].loss_mask)
    assert any("'<|im_start|>'" in line for line in lines if line.split()[2] == "0")
    assert "trained tokens" in text.splitlines()[0]


def test_tool_recipe_learns_to_call_the_tool_through_the_console_script(tmp_path):
    # The random tiny model never writes a valid call (tool-call validity 0, accuracy 0:
    # benchmarks/multiturn_learning.md). A short warm start on reference trajectories and one
    # GRPO step must leave a greedy policy that calls the tool validly and answers from its
    # result. The GRPO gains themselves are the benchmark's (too slow for CI).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    rlflow = str(Path(sys.executable).parent / "rlflow")
    overrides = [
        "grpo.max_num_steps=1",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=2",
        "grpo.max_val_samples=16",
        "grpo.val_at_start=false",  # validated once, at the end
        "loss.kl_penalty=0",  # no reference policy to load
        "warm_start.num_steps=30",
        "warm_start.batch_size=16",
        "checkpointing.enabled=false",
        "logging.progress_bar=false",
        "logging.rollout_dump_period=1",
    ]
    result = subprocess.run(
        [rlflow, "train", str(RECIPE), *overrides, "--run-dir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = records[-1]
    assert step["step"] == 1 and 1.0 <= step["env/turns_per_trajectory"] <= 2.0
    assert "env/malformed_tool_calls" in step
    assert step["val/turns_per_trajectory"] == 2.0, step
    assert step["val/tool_call_validity"] >= 0.75 and step["val/accuracy"] >= 0.25, step
    assert (tmp_path / "rollouts" / "step_000001.txt").exists()
