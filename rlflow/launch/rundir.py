"""The run directory: written completely under a temporary name, then renamed into place.

    RUN_DIR/script.sbatch   the rendered script, exactly as submitted
    RUN_DIR/recipe.yaml     the resolved recipe (cluster filled from --nodes/--gpus)
    RUN_DIR/git.json        commit, dirty flag and submodule commits of the submit directory
    RUN_DIR/job_id          the Slurm job id
    RUN_DIR/logs/           empty: the batch script's and the ranks' logs go here

rlflow/job/files.py names every file of a run directory, those the job writes too.

A reader never sees a half-written run directory, and a failed sbatch leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError
from rlflow.job.files import JOB_ID, LOGS

GIT_TIMEOUT_SECONDS = 30


@dataclass(frozen=True)
class StagedRun:
    """A complete run directory under a temporary name next to its final place."""

    temp: Path
    final: Path

    @property
    def script(self) -> Path:
        return self.temp / "script.sbatch"

    def publish(self, job_id: str) -> Path:
        """Record the job id and move the directory to its final name (one rename)."""
        (self.temp / JOB_ID).write_text(job_id + "\n")
        os.rename(self.temp, self.final)
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.temp, ignore_errors=True)


def stage(run_dir: str, files: dict[str, str]) -> StagedRun:
    """Write `files` (name -> text) and an empty logs/ into a temporary sibling of `run_dir`."""
    final = Path(run_dir)
    if final.exists():
        raise FileExistsError(f"run directory {final} already exists")
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.parent / f".{final.name}.staging"
    temp.mkdir()
    try:
        (temp / LOGS).mkdir()
        for name, text in files.items():
            (temp / name).write_text(text, encoding="utf-8")
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return StagedRun(temp, final)


def remove_published(run_dir: Path) -> None:
    """Undo `publish` when the job could not be released (the job is cancelled by then)."""
    shutil.rmtree(run_dir, ignore_errors=True)


def submit_held(staged: StagedRun, what: str, before_publish=None) -> tuple[str, Path]:
    """The submit transaction: sbatch the staged script on hold, `before_publish(job_id)` (files
    that name the job), rename the directory into place, release the job. On any failure nothing
    is left: the held job is cancelled and the directory removed, and an OSError is a diagnostic
    naming `what` ("run": a job, "sweep": a job array)."""
    from rlflow import slurm

    try:
        job_id = slurm.sbatch_held(staged.script)
    except BaseException:
        staged.discard()
        raise
    try:
        if before_publish is not None:
            before_publish(job_id)
        final = staged.publish(job_id)
        slurm.release(job_id)
    except BaseException as err:
        slurm.cancel_quietly(job_id)  # the held job never ran; take it back with its directory
        staged.discard()
        remove_published(staged.final)
        if isinstance(err, OSError):
            job = "job array" if what == "sweep" else "job"
            raise RlflowError(
                Diagnostic(
                    "submit.run-dir",
                    f"could not move the {what} directory into place at {staged.final}: "
                    f"{err.strerror or err}",
                    help=f"{job} {job_id} was cancelled and nothing is left behind; submit again",
                )
            ) from None
        raise
    return job_id, final


def git_state(directory: str) -> dict:
    """Commit, dirty flag and submodule commits of the repository `directory` is in."""
    top = _git_line(directory, "rev-parse", "--show-toplevel")
    if top is None:
        return {"repository": None, "note": f"{directory} is not inside a git repository"}
    head = _git_line(top, "rev-parse", "--verify", "--quiet", "HEAD")
    changes = _git(top, "status", "--porcelain=v1", "--untracked-files=no") or ""
    return {
        "repository": top,
        "commit": head,
        "dirty": bool(changes.strip()),
        "changed_files": [line[3:] for line in changes.splitlines()],
        "submodules": _submodules(top),
    }


def _submodules(top: str) -> list[dict]:
    """`git submodule status --recursive` as records; state says whether the checkout matches."""
    states = {
        " ": "matches",
        "+": "differs from the recorded commit",
        "-": "not initialized",
        "U": "merge conflict",
    }
    out = _git(top, "submodule", "status", "--recursive") or ""
    records = []
    for line in out.splitlines():
        if len(line) < 42:
            continue
        commit, _, rest = line[1:].partition(" ")
        records.append(
            {"path": rest.split(" (")[0], "commit": commit, "state": states.get(line[0], line[0])}
        )
    return records


def _git(directory: str, *args: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", "-C", directory, *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_SECONDS,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def _git_line(directory: str, *args: str) -> str | None:
    out = _git(directory, *args)
    return out.strip() or None if out is not None else None


def git_json(directory: str) -> str:
    return json.dumps(git_state(directory), indent=2) + "\n"
