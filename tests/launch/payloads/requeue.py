"""Test payload for requeue: stands in for the trainer's checkpoint-on-signal half.

Attempt 0 waits for the time-limit warning, records "saved" and exits 75; a later
attempt (SLURM_RESTART_COUNT > 0) reads that record, appends "resumed" and exits 0. Each rank
leaves OUT_DIR/rank-R.ready once it listens for the warning (a test may then send it). The
warning is the signal the launcher names in RLFLOW_STOP_SIGNAL (slurm.stop_signal, HUP by
default), as the trainer hears it (rlflow/train/signals.py); Slurm sends USR1 to the batch script.
Usage: python requeue.py OUT_DIR
"""

import os
import signal
import sys
import time
from pathlib import Path

WAIT_FOR_WARNING_SECONDS = 300  # far beyond the 1-minute time limit the test uses


def main() -> int:
    out = Path(sys.argv[1])
    rank = os.environ["RANK"]
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    record = out / f"rank-{rank}.txt"
    if attempt > 0:
        # A rank whose node was lost in attempt 0 never saved (tests/job/test_job_recovery.py).
        last = record.read_text().splitlines()[-1] if record.exists() else "nothing saved"
        with open(record, "a") as f:
            f.write(f"attempt {attempt}: resumed after '{last}'\n")
        return 0
    warned = []
    warning = signal.Signals["SIG" + os.environ["RLFLOW_STOP_SIGNAL"]]
    signal.signal(warning, lambda *_: warned.append(time.time()))
    (out / f"rank-{rank}.ready").touch()
    deadline = time.monotonic() + WAIT_FOR_WARNING_SECONDS
    while not warned and time.monotonic() < deadline:
        time.sleep(0.2)
    if not warned:
        return 3
    with open(record, "a") as f:
        f.write("attempt 0: warned, saved\n")
    return 75


if __name__ == "__main__":
    sys.exit(main())
