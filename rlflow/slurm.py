"""Every call rlflow makes to Slurm's client commands: sbatch, scontrol, squeue, sacct, scancel
and sinfo, each with a timeout and an error that says what to do.

Slurm's client commands read `SLURM_CONF` (or /etc/slurm/slurm.conf) like they do in a shell;
nothing here caches or guesses cluster state. Standard library only: the login-node commands
and the batch script's helper (rlflow/job/attempts.py) both use it. (The batch script itself
calls srun and scontrol in bash: templates/sbatch.sh.j2.)
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
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
# GRES strings as sinfo prints them: gpu:4, gpu:h100:8(S:0-1), gpu:a100:4,gpu:v100:2
_GPU_GRES = re.compile(r"gpu(?::[^:,()\s]+)?:(\d+)")
SINFO_TIMEOUT_SECONDS = 5  # a healthy controller answers in well under a second
NODE_STATE_TIMEOUT_SECONDS = 20


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


def start_estimate(job_id: str) -> str | None:
    """The backfill scheduler's expected start (squeue --start); N/A until it has one."""
    result = run(["squeue", "--start", "-h", "-j", job_id, "-o", "%S"])
    text = result.stdout.strip() if result.returncode == 0 else ""
    return text.splitlines()[0] if text else None


def array_task_lines(array_id: str) -> tuple[str | None, str | None]:
    """`JobID|State` lines of a job array's tasks: (sacct's, for ended ones; squeue's, for live
    ones); None where the command failed."""
    record = run(["sacct", "-n", "-X", "-P", "-j", array_id, "-o", "JobID,State"])
    live = run(["squeue", "-h", "-r", "-j", array_id, "-o", "%i|%T"])
    return (
        record.stdout if record.returncode == 0 else None,
        live.stdout if live.returncode == 0 else None,
    )


def node_state(node: str) -> str:
    """`State=... Reason=...` of a node from scontrol, for the record (empty if unknown)."""
    try:
        out = run(["scontrol", "show", "node", "-o", node], timeout=NODE_STATE_TIMEOUT_SECONDS)
    except (OSError, RlflowError):
        return ""
    fields = dict(word.split("=", 1) for word in out.stdout.split() if "=" in word)
    state = fields.get("State", "")
    reason = out.stdout.split("Reason=", 1)[1].strip() if "Reason=" in out.stdout else ""
    return f"State={state}" + (f" Reason={reason}" if reason else "")


def partition_gpus() -> tuple[dict[str, dict[str, int]], str | None] | None:
    """Partition -> node -> GPUs, and the default partition, from `sinfo`; None when Slurm
    cannot be asked (no Slurm config on this machine, no sinfo, or no answer)."""
    config = os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    if not os.path.isfile(config) or shutil.which("sinfo") is None:
        return None
    try:
        result = run(
            ["sinfo", "--noheader", "--Node", "--format=%N|%P|%G"], timeout=SINFO_TIMEOUT_SECONDS
        )
    except (OSError, RlflowError):
        return None
    if result.returncode != 0:
        return None
    gpus: dict[str, dict[str, int]] = {}
    default = None
    for line in result.stdout.splitlines():
        node, _, rest = line.strip().partition("|")
        partition, _, gres = rest.partition("|")
        if partition.endswith("*"):
            partition = default = partition[:-1]
        if node and partition:
            count = sum(int(n) for n in _GPU_GRES.findall(gres))
            gpus.setdefault(partition, {})[node] = count
    return gpus, default
