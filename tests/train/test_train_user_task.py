"""A user's own task end to end through the `rlflow` console script: JSONL files and a reward
module under tests/user_task (no rlflow source touched), the GRPO variants as recipe keys, and
the failures a user meets (a reward that returns NaN, dynamic sampling out of rounds, a typo in
a reward's import path at `submit --dry-run`)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from rlflow.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = ROOT / ".venv" / "bin" / "rlflow"
USER_TASK = ROOT / "tests" / "user_task"
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
QUICK = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=2",
    "grpo.val_period=2",
    "grpo.max_val_samples=8",
    "warm_start.num_steps=4",
    "warm_start.batch_size=8",
    "checkpointing.enabled=false",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]


def rlflow(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run(
        [str(RLFLOW), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_user_jsonl_and_reward_module_train_end_to_end(tmp_path):
    result = rlflow("train", "recipe.yaml", *QUICK, "--run-dir", str(tmp_path), cwd=USER_TASK)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    final = records[-1]
    # each component of the user's dict reward is its own metric; weight-0 rewards do not run
    for name in ("counting", "counting/correct", "counting/plausible", "finished"):
        assert 0 <= final[f"train/reward_count_rewards:{name}"] <= 1
    assert "train/reward_format" not in final
    # accuracy is the recipe's choice: the `correct` component of the user's reward
    assert final["train/accuracy"] == final["train/reward_count_rewards:counting/correct"]
    assert {"val/accuracy", "val/accuracy_image", "val/accuracy_text"} <= set(final)
    # Megatron rollouts in fp32: importance sampling is off (auto), the loss is untouched
    assert not any(k.startswith("train/is_") for k in final)
    assert 0 <= final["train/filtered_fraction"] <= 1


def test_dapo_gspo_and_tis_as_recipe_keys(tmp_path):
    result = rlflow(
        "train",
        str(TINY),
        *QUICK,
        "grpo.dynamic_sampling.enabled=true",
        "grpo.dynamic_sampling.max_extra_rounds=8",
        "loss.overlong_penalty.enabled=true",
        "loss.overlong_penalty.buffer_tokens=4",
        "loss.ratio_level=sequence",
        "loss.token_level_loss=false",
        "loss.importance_sampling.mode=tis",
        "grpo.val_at_start=false",  # no validation metric is looked at here
        "grpo.val_period=0",
        "grpo.val_at_end=false",
        "--run-dir",
        str(tmp_path),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    for r in steps:
        assert -1 <= r["train/reward_overlong_penalty"] <= 0
        assert 0 <= r["train/filtered_fraction"] < 1
        assert r["train/extra_rounds"] >= 0 and r["train/generated_tokens"] > 0
        assert r["train/preempted_rows"] == 0  # the CPU cache holds every row's worst case
        # the generator is the policy itself in fp32: weights are 1 up to rounding, none clipped
        assert math.isclose(r["train/is_weight_mean"], 1.0, abs_tol=1e-5)
        assert r["train/is_weight_max"] <= 1 + 1e-5 and r["train/is_clipped_fraction"] == 0


def test_a_nan_reward_stops_the_run_naming_the_function_and_the_sample(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "bad_rewards.py").write_text(
        "def shaky(batch):\n"
        "    return [float('nan') if 'How many' in p else 1.0 for p in batch.prompts]\n"
    )
    result = rlflow(
        "train", str(TINY), *QUICK, "warm_start.num_steps=0", "grpo.val_at_start=false",
        "rewards.bad_rewards:shaky=1.0", "--run-dir", str(tmp_path / "run"), cwd=work,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "error[reward.failed]: reward `bad_rewards:shaky` returned nan on row clevr/1/" in (
        result.stderr
    )
    assert "prompt: 'How many" in result.stderr and "answer: '" in result.stderr
    assert "Traceback" not in result.stderr


def test_dynamic_sampling_out_of_rounds_is_a_clear_error(tmp_path):
    # A constant reward: every group has zero variance, so no round can fill the batch.
    work = tmp_path / "work"
    work.mkdir()
    (work / "flat.py").write_text("def one(batch):\n    return [1.0] * len(batch)\n")
    result = rlflow(
        "train", str(TINY), *QUICK, "warm_start.num_steps=0", "grpo.val_at_start=false",
        "rewards.flat:one=1.0", "rewards.format=0", "rewards.exact_match=0",
        "grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.max_extra_rounds=1",
        "--run-dir", str(tmp_path / "run"), cwd=work,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "error[grpo.dynamic-sampling-exhausted]: dynamic sampling: after 1 extra generation "
        "rounds only 0 of 4 prompt groups have rewards that differ (8 of 8 groups"
    ) in result.stderr
    assert "raise grpo.dynamic_sampling.max_extra_rounds" in result.stderr
    assert "Traceback" not in result.stderr


def test_dry_run_names_a_missing_reward_function_with_file_and_line_without_torch(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        f"defaults: {USER_TASK / 'recipe.yaml'}\n"
        "rewards:\n"
        "  count_rewards:counting: 1.0\n"
        "  count_rewards:countng: 0.5\n"
        "  score_lib.missing:fn: 0.5\n"
    )
    code = (
        "import sys\nfrom rlflow.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    status = done.code\n"
        "heavy = [m for m in ('torch', 'megatron', 'transformers', 'count_rewards') "
        "if m in sys.modules]\n"
        "print('heavy modules:', heavy, file=sys.stderr)\nsys.exit(status)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "submit", str(recipe), "--nodes", "1", "--gpus", "1",
         "--dry-run"],
        cwd=USER_TASK, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    err = result.stderr
    assert "module `count_rewards` (" in err and "has no function `countng`" in err
    assert f"--> {recipe}:4" in err
    assert "did you mean `count_rewards:counting`?" in err
    assert "no module `score_lib.missing` is importable from" in err and f"{recipe}:5" in err
    assert "heavy modules: []" in err
