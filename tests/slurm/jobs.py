"""Shared pieces of the launch and job tests: run the real `rlflow` CLI, wait for real Slurm
jobs. The recipes and payloads (stand-ins for the trainer) live in tests/launch/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "tests" / "launch" / "recipes"
PAYLOADS = REPO / "tests" / "launch" / "payloads"
BASE_RECIPE = REPO / "recipes" / "base.yaml"
PYTHON = sys.executable
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def rlflow(
    *args: str, cwd: Path = REPO, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess (the way users run it)."""
    return subprocess.run(
        [PYTHON, "-m", "rlflow.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_printed(result: subprocess.CompletedProcess, *texts: str) -> None:
    """The command succeeded and printed each of `texts` on stdout (its stderr when it failed)."""
    assert result.returncode == 0, result.stderr
    for text in texts:
        assert text in result.stdout, f"{text!r} is not in the output:\n{result.stdout}"


def write_recipe(path: Path, data: dict, defaults: Path = BASE_RECIPE) -> Path:
    """A recipe file extending `defaults`; yaml.safe_dump quotes hostile values correctly."""
    text = f"defaults: {os.path.relpath(defaults, path.parent)}\n" + yaml.safe_dump(
        data, sort_keys=False
    )
    path.write_text(text)
    return path


def submit(recipe: Path, *args: str, cwd: Path, command: str | None = None) -> tuple[str, Path]:
    """`rlflow submit` for real; the job id and run directory, or a failed test with the output."""
    extra = ["--command", command] if command is not None else []
    result = rlflow("submit", str(recipe), *args, *extra, cwd=cwd)
    assert result.returncode == 0, f"rlflow submit failed:\n{result.stdout}\n{result.stderr}"
    job_id = re.search(r"submitted job (\d+)", result.stdout)[1]
    run_dir = Path(re.search(r"run dir: (.*)", result.stdout)[1].strip())
    return job_id, run_dir


def payload_command(name: str, *args: str) -> str:
    return " ".join([PYTHON, str(PAYLOADS / name), *args])


def job_fields(job_id: str) -> dict[str, str]:
    from rlflow.slurm import job_fields as fields

    found = fields(job_id)
    assert found is not None, f"scontrol does not know job {job_id}"
    return found


def wait_for_state(
    job_id: str, states: set[str], timeout: float, run_dir: Path | None = None
) -> dict[str, str]:
    """Poll scontrol until the job is in one of `states`. The timeout is a hang guard, not a
    speed check: reaching it fails the test with the job's state and batch log."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(job_id)
        if fields["JobState"] in states:
            return fields
        if time.monotonic() > deadline:
            log = ""
            if run_dir is not None and (run_dir / "logs" / f"slurm-{job_id}.out").exists():
                log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
            pytest.fail(
                f"job {job_id} did not reach {sorted(states)} within {timeout:.0f} s: "
                f"{fields.get('JobState')} ({fields.get('Reason')})\n{log}"
            )
        time.sleep(0.5)


def wait_done(job_id: str, timeout: float = 300, run_dir: Path | None = None) -> dict[str, str]:
    return wait_for_state(job_id, FINAL_STATES, timeout, run_dir)


def batch_log(run_dir: Path, job_id: str) -> str:
    return (run_dir / "logs" / f"slurm-{job_id}.out").read_text()


def wait_for_files(paths: list[Path], job: str, run_dir: Path, timeout: float = 120) -> None:
    """Until every path exists (the marks a payload leaves); the timeout is a hang guard, and a
    job that ends first fails the test with its batch log."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        state = job_fields(job)["JobState"]
        if time.monotonic() > deadline or state not in ("PENDING", "CONFIGURING", "RUNNING"):
            log = run_dir / "logs" / f"slurm-{job}.out"
            missing = [str(p) for p in paths if not p.exists()]
            pytest.fail(
                f"never appeared: {missing} ({state})\n{log.read_text() if log.exists() else ''}"
            )
        time.sleep(0.2)
