"""Test payload: a stand-in trainer that reports progress the way `rlflow train` does.

Every rank joins a gloo process group, then runs STEPS steps. A step reports phase `compute`,
sleeps in `compute()`, reports phase `exchange` and sums a tensor over all ranks in
`exchange_gradients()`. Rank 0 records each finished step in OUT_DIR/steps.txt, and a later
attempt resumes after the last recorded step (the stand-in for a checkpoint). The phase timeout
(seconds) is the recipe's watchdog.phase_timeout_s.
Usage: python progress.py OUT_DIR STEPS PHASE_TIMEOUT_S [STEP_SECONDS]
"""

import datetime
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from rlflow.train import watchdog


def compute(seconds: float) -> None:
    time.sleep(seconds)


def exchange_gradients() -> float:
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


def main() -> int:
    out, steps, timeout = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    step_seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 0.5
    watchdog.start()
    watchdog.configure(
        SimpleNamespace(
            enabled=True,
            startup_timeout_s=120,
            preflight_timeout_s=120,
            model_load_timeout_s=120,
            checkpoint_timeout_s=120,
            phase_timeout_s=timeout,
        )
    )
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    record = out / "steps.txt"
    done = record.read_text().split() if record.exists() else []
    first = int(done[-1]) + 1 if done else 1
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    for step in range(first, steps + 1):
        watchdog.beat("compute", step)
        compute(step_seconds)
        watchdog.beat("exchange")
        assert exchange_gradients() == dist.get_world_size()
        if rank == 0:
            with open(record, "a") as f:
                f.write(f"{step}\n")
            with open(out / "attempts.txt", "a") as f:
                f.write(f"{attempt} {step} {os.environ.get('SLURM_JOB_NODELIST', '')}\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
