"""Test payload: a gloo all-reduce over every rank of the job, with the sum checked.

Each rank contributes rank + 1, so the sum must be W * (W + 1) / 2. Every rank writes what it
saw (its place in the job and the sum) to OUT_DIR/rank-<RANK>.json and exits 1 on a wrong sum.
Usage: python allreduce.py OUT_DIR
"""

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# 32 ranks importing torch on a 2-core machine reach the rendezvous over a minute apart.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=RENDEZVOUS_TIMEOUT)  # env://: MASTER_ADDR, RANK, ...
    rank, world_size = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)], dtype=torch.float64)
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) / 2
    record = {
        "rank": rank,
        "world_size": world_size,
        "sum": value.item(),
        "expected": expected,
        "env": {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "NODE_RANK",
                "MASTER_ADDR",
                "MASTER_PORT",
                "SLURMD_NODENAME",
                "SLURM_JOB_ID",
            )
        },
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(record, indent=1))
    dist.destroy_process_group()
    return 0 if value.item() == expected else 1


if __name__ == "__main__":
    sys.exit(main())
