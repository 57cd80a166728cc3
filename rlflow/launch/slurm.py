"""sbatch, scontrol, sacct and scancel: each call with a timeout and an error that says what to do.

Slurm's client commands read `SLURM_CONF` (or /etc/slurm/slurm.conf) like they do in a shell;
nothing here caches or guesses cluster state.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError, print_diagnostics

TIMEOUT_SECONDS = 60
# States after which a job does not run again by itself.
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
    "REVOKED",
    "SPECIAL_EXIT",
}
_KEY = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=")


def run(args: list[str], timeout: float = TIMEOUT_SECONDS) -> subprocess.CompletedProcess:
    """Run a Slurm client command; a missing binary or a silent controller is an RlflowError."""
    shown = shlex.join(args)
    try:
        return subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise RlflowError(
            Diagnostic(
                "slurm.not-found",
                f"`{args[0]}` is not on PATH",
                help="run this on a Slurm login node (or put Slurm's client commands on PATH); "
                "`--dry-run` needs no Slurm",
            ),
            EXIT_FINDINGS,
        ) from None
    except subprocess.TimeoutExpired:
        raise RlflowError(
            Diagnostic(
                "slurm.timeout",
                f"`{shown}` did not answer within {timeout:g} s",
                help="is the controller reachable? `scontrol ping` says; SLURM_CONF picks the cluster",
            ),
            EXIT_FINDINGS,
        ) from None


def failed(what: str, result: subprocess.CompletedProcess, help: str | None = None) -> RlflowError:
    message = (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"
    return RlflowError(Diagnostic("slurm.error", f"{what}: {message}", help=help), EXIT_FINDINGS)


def sbatch_held(script: Path) -> str:
    """Submit `script` on hold (released once its run directory is in place); the job id."""
    result = run(["sbatch", "--parsable", "--hold", str(script)])
    if result.returncode != 0:
        raise failed(
            "sbatch refused the job",
            result,
            help="fix what sbatch says (partition, account, limits) and submit again; "
            "nothing was submitted",
        )
    job_id = result.stdout.strip().split(";")[0]
    if not re.fullmatch(r"\d+", job_id):
        raise failed(f"sbatch printed {result.stdout.strip()!r} instead of a job id", result)
    return job_id


def release(job_id: str) -> None:
    result = run(["scontrol", "release", job_id])
    if result.returncode != 0:
        raise failed(f"could not release job {job_id}", result)


def cancel(job_id: str) -> subprocess.CompletedProcess:
    return run(["scancel", job_id])


def cancel_quietly(job_id: str) -> None:
    """Take back a held job after a failed submission; a failure to cancel is printed, not raised."""
    try:
        cancel(job_id)
    except RlflowError as err:
        print_diagnostics(err.diagnostics)


def job_fields(job_id: str) -> dict[str, str] | None:
    """`scontrol show job -o` as a dict; None once the controller has forgotten the job."""
    result = run(["scontrol", "show", "job", "-o", job_id])
    if result.returncode != 0:
        if "Invalid job id" in result.stderr:
            return None
        raise failed(f"scontrol could not show job {job_id}", result)
    return parse_fields(result.stdout.strip().splitlines()[0]) if result.stdout.strip() else None


def parse_fields(line: str) -> dict[str, str]:
    """`Key=value Key=value ...` where values may hold spaces (job names, paths)."""
    matches = list(_KEY.finditer(line))
    fields = {}
    for match, following in zip(matches, matches[1:] + [None], strict=True):
        end = following.start() if following else len(line)
        fields[match[1]] = line[match.end() : end].strip()
    return fields


def accounting(job_id: str) -> dict[str, str] | None:
    """The job's record in slurmdbd (sacct), for jobs the controller no longer shows."""
    # JobName last: a name may hold the "|" separator, so it takes whatever remains.
    columns = [
        "JobID",
        "State",
        "ExitCode",
        "Elapsed",
        "Timelimit",
        "NodeList",
        "Start",
        "End",
        "JobName",
    ]
    result = run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", ",".join(columns)])
    lines = result.stdout.strip().splitlines() if result.returncode == 0 else []
    values = lines[-1].split("|", len(columns) - 1) if lines else []
    if len(values) != len(columns):
        return None
    return dict(zip(columns, values, strict=True))


def job_state(job_id: str) -> str | None:
    """RUNNING, PENDING, COMPLETED, ... (scontrol first, then sacct); None if unknown."""
    fields = job_fields(job_id)
    if fields is not None:
        return fields.get("JobState")
    record = accounting(job_id)
    return record["State"].split()[0] if record else None
