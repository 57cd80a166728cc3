"""Test payload: `rlflow train`'s start-up up to and including its preflight, without the model.

Reads the recipe, starts the watchdog, joins a gloo process group and runs the trainer's own
preflight (rlflow.job.preflight.run_preflight): the same checks, gathering and exit codes
(78 on a failing node, 76 on the others), in seconds instead of a model load.
Usage: python preflight.py (in a job: the run directory is $RLFLOW_RUN_DIR, its recipe.yaml
the submitted recipe)
"""

import datetime
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from rlflow.job.preflight import PreflightFailed, run_preflight
from rlflow.rules import load_checked
from rlflow.train import watchdog


def main() -> int:
    run_dir = Path(os.environ["RLFLOW_RUN_DIR"])
    recipe = load_checked(str(run_dir / "recipe.yaml"), []).recipe
    watchdog.start()
    watchdog.configure(recipe.watchdog)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    info = SimpleNamespace(
        rank=dist.get_rank(),
        local_rank=int(os.environ["LOCAL_RANK"]),
        world_size=dist.get_world_size(),
        device=torch.device("cpu"),
        is_main=dist.get_rank() == 0,
    )
    watchdog.beat("preflight")
    try:
        run_preflight(recipe.preflight, run_dir, None, info)
    except PreflightFailed as err:
        if err.note:
            watchdog.note(err.note)
        print(f"[rank {info.rank}] {err}", file=sys.stderr, flush=True)
        os._exit(err.exit_code)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
