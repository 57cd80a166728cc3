"""What runs inside a job: under srun on every node, in the batch script, and on every rank.

    node.py        the per-node launcher (`python -m rlflow.job.node`, one per node under srun,
                   or `rlflow train --nproc N` on this machine): starts and watches the ranks
    ranks.py       the rank processes: environment, logs, process groups, stop, the reaper
    forwarding.py  signals to the launcher; the time-limit warning passed on to the ranks
    hangs.py       the hang watch: a rank silent past its phase's timeout, and whose node names it
    dumps.py       every local rank's stacks when a hang is found
    books.py       what the launcher records in the status directory; the root-cause rule
    attempts.py    the batch script's helper after each attempt (`python -m rlflow.job.attempts`):
                   done, requeue for the time limit, retry without a node, or fail
    preflight.py   called by every rank before the model loads: GPUs, GEMM, disk, env, all-reduce
    files.py       the run directory's file names and record formats (the login-node commands
                   read them too)
    local.py       `rlflow train --nproc N`: node.py's launcher on this machine, with its
                   attempt record and a resume command

Everything here but preflight.py is standard library only: the launcher starts in a fraction of
a second on every node. Nothing here imports rlflow.launch (the login-node commands).
"""
