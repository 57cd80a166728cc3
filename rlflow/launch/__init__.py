"""`rlflow submit`, `status`, `logs`, `cancel`: recipes rendered to sbatch and run on Slurm.

The submit flow is `load -> plan -> render -> check -> (dry run: show) -> stage -> sbatch`:

    plan.py     recipe + flags -> JobPlan (every value the script needs); pure
    render.py   JobPlan -> sbatch text (templates/sbatch.sh.j2, every value shell-quoted)
    check.py    the checks submit and --dry-run share: plan values, pins, paths, bash -n
    rundir.py   the run directory, written atomically, with the git state
    slurm.py    sbatch / squeue / scontrol / sacct / scancel with timeouts and clear errors
    command.py  the Click commands (submit here; status/logs/cancel through jobs.py)
    jobs.py     a job id or run directory -> its state, logs, cancellation
    node.py     on the allocation: one per node, starts and watches that node's ranks

Everything here except node.py runs on login nodes: no torch, megatron or transformers.
"""
