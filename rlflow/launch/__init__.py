"""`rlflow submit`, `status`, `logs`, `cancel` and `report`: the login-node commands. What runs inside the
job lives in rlflow/job/; every call to Slurm goes through rlflow/slurm.py.

The submit flow is `load -> plan -> render -> check -> (dry run: show) -> stage -> sbatch`:

    command.py       the Click commands (submit here; status/logs/cancel through jobs.py)
    prepare.py       the submit pipeline a job and a sweep share: recipe + flags -> checked plan
    plan.py          recipe + flags -> JobPlan (every value the script needs); pure
    render.py        JobPlan -> sbatch text (templates/sbatch.sh.j2, every value shell-quoted)
    check.py         the checks submit and --dry-run share: plan values, pins, paths, bash -n
    cost.py          GPU-hours of a plan, its worst case with requeues, and the cap
    rundir.py        the run directory, written atomically, with the git state
    jobs.py          a job id or run directory -> its state, logs, cancellation
    monitor.py       `rlflow status --watch`: one screen about a job, redrawn
    sweep.py         `--sweep` axes -> elements, and the sweep directory's manifest
    sweep_submit.py  a sweep's elements planned, checked and submitted as one job array
    sweep_jobs.py    `rlflow status` and `cancel` of a sweep
    report.py        `rlflow report`: PNG plots of a run's metrics.jsonl

Everything here runs on login nodes: no torch, megatron or transformers.
"""
