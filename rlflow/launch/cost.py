"""GPU-hours before anything is queued: one attempt, the worst case, and the recipe's cap.

A job may run its whole time limit once per attempt. Attempts are the first one, every
time-limit requeue (slurm.max_requeues) and every node-failure retry (slurm.max_failure_retries);
rlflow/job/attempts.py counts the two kinds separately, so the worst case is their sum plus
one. A sweep's worst case is the sum of its elements'. `slurm.max_gpu_hours` caps the worst case
of one submission (a job, or a whole sweep).
"""

from __future__ import annotations

from rlflow.errors import Diagnostic
from rlflow.launch.plan import JobPlan
from rlflow.recipe.load import LoadedRecipe

CAP_KEY = ("slurm", "max_gpu_hours")


def attempts_at_most(plan: JobPlan) -> int:
    return 1 + plan.max_requeues + plan.max_failure_retries


def worst_case(plan: JobPlan) -> float:
    return plan.gpu_hours * attempts_at_most(plan)


def hours(value: float) -> str:
    """GPU-hours as printed: one decimal, more where one would hide a small job."""
    return f"{value:.1f}" if value == 0 or value >= 0.95 else f"{value:.2g}"


def attempts_text(plan: JobPlan) -> str:
    return (
        f"{attempts_at_most(plan)} attempts: the first + slurm.max_requeues {plan.max_requeues} "
        f"+ slurm.max_failure_retries {plan.max_failure_retries}"
    )


def cap_text(loaded: LoadedRecipe) -> str:
    cap = loaded.recipe.slurm.max_gpu_hours
    return "no cap (slurm.max_gpu_hours)" if cap is None else f"cap {cap:g} (slurm.max_gpu_hours)"


def cap_problems(
    loaded: LoadedRecipe, worst: float, what: str, notes: tuple[str, ...] = ()
) -> list[Diagnostic]:
    """An error when `worst` GPU-hours (of `what`: "this job", "this sweep") exceed the cap."""
    cap = loaded.recipe.slurm.max_gpu_hours
    if cap is None or worst <= cap:  # (a negative cap is the key's own bound)
        return []
    sweep_help = ", fewer sweep values" if what.startswith("this sweep") else ""
    return [
        loaded.diagnostic(
            CAP_KEY,
            "submit.gpu-hours-cap",
            f"{what} may use {worst:.4g} GPU-hours in the worst case, over the cap of "
            f"{cap:g} (slurm.max_gpu_hours); nothing was submitted",
            help="fewer --nodes or --gpus, a shorter slurm.time_limit, fewer slurm.max_requeues "
            f"or slurm.max_failure_retries{sweep_help}; or raise slurm.max_gpu_hours to "
            f"{worst:.4g} if you mean it",
        ).replace(notes=notes)
    ]
