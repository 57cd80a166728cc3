"""A reward worker that dies in a 2-rank run ends the job as that rank's failure, named.

Before, rank 1's multiprocessing.Pool lost the dead worker's task and the run waited
scoring.timeout_s, then ended with "did not return within 60 s", or, when the worker the pool
spawned to replace the dead one started after terminate() had sent its stop sentinels, hung in
terminate() (that worker held the task queue's read lock): the launcher's watchdog then ended
the job with exit 77, "node hung", which the Slurm retry decision answers by excluding a healthy
node. The real trainer through the console script, 2 CPU ranks.

It is also the suite's end-to-end run of one failing data-parallel rank: rank 0, left waiting
for rank 1 in the step, is stopped without a traceback of its own (the subprocess timeout is
the hang detector). A generic exception on one rank: test_train_async.py's sync faults.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = ROOT / ".venv" / "bin" / "rlflow"
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"

REWARD = """
import ctypes, os


def reward(batch):
    if os.environ["RANK"] == "1":  # the worker inherits its rank's environment
        ctypes.string_at(0)  # a crash in native code: the worker process dies of SIGSEGV
    return [0.0] * len(batch)
"""

RECIPE = f"""
defaults: {TINY}
rewards: {{format: 0.5, exact_match: 0.5, "crash:reward": 0.1}}
scoring: {{num_workers: 2, timeout_s: 60}}   # the defaults
watchdog: {{phase_timeout_s: 120}}   # a hang would end the job as 77 after this
"""

QUICK = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.max_num_steps=2",
    "grpo.val_at_start=false",
    "grpo.val_period=0",
    "warm_start.num_steps=0",
    "checkpointing.enabled=false",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]


def test_a_dead_reward_worker_is_a_named_rank_failure_not_a_hang(tmp_path):
    (tmp_path / "crash.py").write_text(REWARD)
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [str(RLFLOW), "train", "recipe.yaml", *QUICK, "--nproc", "2", "--run-dir", str(run_dir)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]  # the reward error's code, not 77 (a hang)
    assert "rank 1 exited with code 1" in output
    first = (run_dir / "status" / "attempt-0" / "first-failure").read_text().splitlines()
    assert first[0] == "1" and first[1].startswith("rank 1 on "), first
    rank1 = (run_dir / "logs" / "rank-1.log").read_text()
    assert "reward `crash:reward` killed its worker process (SIGSEGV" in rank1
    assert " on row " in rank1
    assert "Traceback" not in (run_dir / "logs" / "rank-0.log").read_text()
