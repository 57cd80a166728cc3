"""Hostile recipe values (issue 23, items 7 and 8): each is refused with the key, the value and
the fix, exit 2 and no traceback, by `rlflow submit --dry-run` (the console script, nothing
written) and by `rlflow train`'s own checks (load_checked, then the allocation rules at setup),
which the dry run runs too. Each case was accepted, or crashed, before its fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.rules import load_checked
from rlflow.rules.allocation import check_allocation

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = str(ROOT / ".venv" / "bin" / "rlflow")
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
HUGE = str(10**100)

# override -> (code, the start of the message); the help is checked to be there
CASES = {
    "slurm.cpus_per_task=0": ("recipe.range", "`slurm.cpus_per_task` must be at least 1 (it is 0)"),
    "slurm.mem=lots": (
        "recipe.slurm-value",
        "`slurm.mem` is 'lots', which Slurm does not read as a memory size",
    ),
    "slurm.partition=''": (
        "recipe.slurm-value",
        "`slurm.partition` is '': a Slurm name cannot be empty or hold spaces",
    ),
    "slurm.time_limit=1:99": (
        "recipe.time-limit",
        "`slurm.time_limit` is '1:99', which Slurm does not read as a time: seconds go up to "
        "59, not 99",
    ),
    f"grpo.max_num_steps={HUGE}": (
        "recipe.range",
        "`grpo.max_num_steps` must be in [1, 10000000] (it is a 101-digit number)",
    ),
    f"run.seed={HUGE}": (
        "recipe.range",
        "`run.seed` must fit in 64 bits (at most 9223372036854775807), not a 101-digit number",
    ),
    "preflight.required_env=[HF_HOME, A-B]": (
        "recipe.env-name",
        "`preflight.required_env[1]` is 'A-B', which is not a valid environment variable name",
    ),
    "watchdog.collective_timeout_s=100000000000000": (
        "recipe.range",
        "`watchdog.collective_timeout_s` must be in [1, 2592000] (it is 100000000000000)",
    ),
    "preflight.allreduce_mb=1000000000": (
        "recipe.range",
        "`preflight.allreduce_mb` must be in [0, 4096] (it is 1000000000)",
    ),
    "scoring.timeout_s=1e10": (
        "recipe.range",
        "`scoring.timeout_s` must be in (0, 86400] (it is 1e+10)",
    ),
    "slurm.container.apptainer_command=apptainer 'x": (
        "recipe.apptainer-command",
        '`slurm.container.apptainer_command` is "apptainer \'x", which cannot be split into '
        "words: No closing quotation",
    ),
    "rewards={format: 1e308, exact_match: 1e308}": (
        "recipe.range",
        "the `rewards` weights (1e+308 + 1e+308) add up to inf: each reward's share is its "
        "weight over the total",
    ),
    "logging.wandb.entity=123": (
        "recipe.ambiguous",
        "`logging.wandb.entity` is 123 without quotes, which YAML reads as the number 123",
    ),
    "logging.wandb.group=[a]": (
        "recipe.type",
        "`logging.wandb.group` is a list, but must be a string or null",
    ),
}


def train_refusal(override: str):
    """The checks `rlflow train` runs before any model: load_checked, then check_allocation."""
    with pytest.raises(RlflowError) as caught:
        check_allocation(load_checked(TINY, [override]), 1)
    return caught.value


@pytest.mark.parametrize("override", sorted(CASES))
def test_a_hostile_value_is_refused_by_the_dry_run_and_by_train(override, tmp_path):
    code, message = CASES[override]
    result = subprocess.run(
        [RLFLOW, "submit", str(TINY), override, "--nodes", "1", "--gpus", "1", "--dry-run"]
        + ["--skip-pin-check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"error[{code}]: {message}" in result.stderr
    assert "\nhelp: " in result.stderr.split(f"error[{code}]: {message}", 1)[1].split("error[")[0]
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir()), "nothing is written for a refused recipe"
    refused = train_refusal(override)
    assert refused.exit_code == 2
    assert any(d.code == code and d.message.startswith(message) for d in refused.diagnostics)


def test_a_time_flag_out_of_range_is_refused(tmp_path):
    """`--time 1:99` (99 seconds) was read as 159 s; the flag and the key share one parser."""
    result = subprocess.run(
        [RLFLOW, "submit", str(TINY), "--time", "1:99", "--nodes", "1", "--gpus", "1"]
        + ["--dry-run", "--skip-pin-check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert "error[submit.time]: `--time 1:99` is not a Slurm time limit" in result.stderr
    assert "Traceback" not in result.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "override",
    [
        "logging.wandb.entity='123'",  # quoted: the name 123, as written
        "logging.wandb.group='[a]'",
        "slurm.mem=64",  # megabytes
        "slurm.mem=64G",
        "slurm.time_limit='59:59'",
        "slurm.time_limit='48:00:00'",  # hours may pass 23 without days
        "slurm.time_limit='1-23:59:59'",
        "slurm.partition=gpu,debug",  # Slurm takes a list of partitions
    ],
)
def test_the_values_beside_them_still_load(override):
    load_checked(TINY, [override])


def test_a_gpu_hour_cap_of_0_is_fine_for_a_job_without_gpus(tmp_path):
    """`request_gpus: false` uses 0 GPU-hours: a cap of 0 holds (it refused before)."""
    cpu = ["slurm.max_gpu_hours=0", "slurm.request_gpus=false"]
    result = subprocess.run(
        [RLFLOW, "submit", str(TINY), *cpu, "--nodes", "1", "--gpus", "2", "--dry-run"]
        + ["--skip-pin-check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    gpus = subprocess.run(
        [RLFLOW, "submit", str(TINY), "slurm.max_gpu_hours=0", "--nodes", "1", "--gpus", "2"]
        + ["--dry-run", "--skip-pin-check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert gpus.returncode == 2
    assert "over the cap of 0 (slurm.max_gpu_hours); nothing was submitted" in gpus.stderr
    negative = train_refusal("slurm.max_gpu_hours=-1")
    assert "`slurm.max_gpu_hours` must not be negative (it is -1)" in str(
        [d.message for d in negative.diagnostics]
    )
