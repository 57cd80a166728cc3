"""In-job preflight: every rank checks its node before any model is loaded.

    gpus   GPUs visible on the node against the GPUs the job asked for there
    gemm   (GPU nodes) an n x n matmul on this rank's GPU against the CPU's answer
    disk   free space in the run directory against one checkpoint plus preflight.min_free_disk_gb
    env    the variables in preflight.required_env are set; python/torch/CUDA versions agree with
           rank 0's

The results are gathered on every rank, so all of them agree: a failure names the node and the
check, the failing node's ranks exit 78 (a node failure: the batch script requeues without that
node) and the others 76 (a peer failed); the caller puts `PreflightFailed.note` into the rank's
progress report, where the launcher reads why (rlflow/train/main.py). Then one all-reduce over
all ranks, with its bandwidth logged where there are several. The line names only the checks
that had something to check on the job's machines. torch is imported inside the functions: the
login node imports this module's names only.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlflow.errors import EX_PEER_FAILED, EX_PREFLIGHT

# The test cluster's GPUs are fake device files and torch there is a CPU build, so the driver's
# view of a node is faked too: "node2:3" makes node2 show 3 GPUs. Tests only.
TEST_VISIBLE_GPUS_ENV = "RLFLOW_TEST_VISIBLE_GPUS"


class PreflightFailed(Exception):
    def __init__(self, message: str, exit_code: int, note: str | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.note = note  # this node's own failures, for the job's failure record


@dataclass
class NodeReport:
    rank: int
    node_rank: int
    host: str
    failures: list[str] = field(default_factory=list)  # "check: what is wrong"
    checked: list[str] = field(default_factory=list)  # the checks that had something to check
    versions: dict[str, str] = field(default_factory=dict)


def hostname() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def visible_gpus() -> int | None:
    """GPUs this node's driver shows this process; None where torch has no CUDA at all (a CPU
    build) and Slurm handed out no GPUs."""
    import torch

    fake = _test_visible_gpus()
    if fake is not None:
        return fake
    if torch.version.cuda is not None and torch.cuda.is_available():
        return torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if listed or os.environ.get("SLURM_GPUS_ON_NODE"):
        # A CPU build of torch on a node with a GPU allocation (the test cluster): Slurm's list.
        return len([d for d in listed.split(",") if d.strip()])
    return None


def _test_visible_gpus() -> int | None:
    for item in os.environ.get(TEST_VISIBLE_GPUS_ENV, "").split(","):
        node, _, count = item.partition(":")
        if node and node == hostname() and count.isdigit():
            return int(count)
    return None


def check_gpus(wanted: int, visible: int | None = None) -> list[str]:
    visible = visible_gpus() if visible is None else visible
    if visible is None or visible >= wanted:
        return []
    return [f"gpus: {visible} GPU{'s' * (visible != 1)} visible, {wanted} requested"]


def check_gemm(size: int, tolerance: float, device) -> list[str]:
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator, dtype=torch.float32)
    b = torch.randn(size, size, generator=generator, dtype=torch.float32)
    expected = a @ b
    try:
        got = (a.to(device) @ b.to(device)).cpu()
    except RuntimeError as err:  # a GPU that fails outright
        return [f"gemm: {size}x{size} matmul failed on {device}: {err}"]
    error = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
    if not error <= tolerance:  # NaN fails too
        return [
            f"gemm: {size}x{size} matmul on {device} differs from the CPU by {error:.3g} "
            f"(relative; preflight.gemm_tolerance={tolerance})"
        ]
    return []


def checkpoint_bytes(run_dir: Path, model_dir: str | None) -> int:
    """What one save needs: the newest checkpoint's size, else 3x the model's files (weights and
    two Adam moments) where the model is a local directory, else 0."""
    steps = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    if steps:
        return _tree_size(steps[-1])
    if model_dir and Path(model_dir).is_dir():
        return 3 * _tree_size(Path(model_dir))
    return 0


def _tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def check_disk(run_dir: Path, need_bytes: int, min_free_gb: float) -> list[str]:
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError as err:
        return [f"disk: cannot read free space of {run_dir}: {err}"]
    want = need_bytes + min_free_gb * 2**30
    if free < want:
        return [
            f"disk: {free / 2**30:.1f} GiB free in {run_dir}, a checkpoint needs "
            f"{need_bytes / 2**30:.1f} GiB + preflight.min_free_disk_gb={min_free_gb:g}"
        ]
    return []


def check_env(required: list[str]) -> list[str]:
    missing = [name for name in required if not os.environ.get(name)]
    if missing:
        return [f"env: {', '.join(missing)} not set (preflight.required_env)"]
    return []


def versions() -> dict[str, str]:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }


def local_report(cfg, run_dir: Path, model_dir: str | None, info) -> NodeReport:
    """This rank's checks (node-wide ones on local rank 0 only), and the names of those that had
    something to check here: no "gpus" on a node without GPUs, no "env" where no variable is
    required and no other rank's versions can differ."""
    report = NodeReport(info.rank, int(os.environ.get("NODE_RANK", "0")), hostname())
    report.versions = versions()
    if info.local_rank == 0:
        visible = visible_gpus()
        if visible is not None:
            report.checked.append("gpus")
            report.failures += check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), visible)
    if info.device.type == "cuda":
        report.checked.append("gemm")
        report.failures += check_gemm(cfg.gemm_size, cfg.gemm_tolerance, info.device)
    if info.local_rank == 0:
        report.checked.append("disk")
        report.failures += check_disk(
            run_dir, checkpoint_bytes(run_dir, model_dir), cfg.min_free_disk_gb
        )
        report.failures += check_env(cfg.required_env)
    if cfg.required_env or info.world_size > 1:
        report.checked.append("env")
    return report


def compare_versions(reports: list[NodeReport]) -> None:
    reference = reports[0]
    for report in reports[1:]:
        for key, value in report.versions.items():
            if value != reference.versions.get(key):
                report.failures.append(
                    f"env: {key} {value} here, {reference.versions.get(key)} on rank 0 "
                    f"({reference.host})"
                )


def run_preflight(cfg, run_dir: Path, model_dir: str | None, info, log=print) -> None:
    """Every rank calls this after the process group is up, before any model is loaded."""
    from rlflow import parallel

    start = time.perf_counter()
    reports = parallel.all_gather_objects(local_report(cfg, run_dir, model_dir, info))
    compare_versions(reports)
    failed = [r for r in reports if r.failures]
    if failed:
        lines = [f"{r.host} (rank {r.rank}): {'; '.join(r.failures)}" for r in failed]
        mine = next((r for r in failed if r.rank == info.rank), None)
        bad_nodes = {r.host for r in failed}
        if mine is not None:
            raise PreflightFailed(
                "preflight failed on " + "; ".join(lines),
                EX_PREFLIGHT,
                note=f"failed preflight: {'; '.join(mine.failures)}",
            )
        code = EX_PREFLIGHT if hostname() in bad_nodes else EX_PEER_FAILED
        raise PreflightFailed(
            f"preflight failed on {', '.join(sorted(bad_nodes))} (reported there)", code
        )
    seconds, size = allreduce_seconds(cfg.allreduce_mb, info)
    if info.is_main:
        log(summary(reports, info.world_size, seconds, size, time.perf_counter() - start))


def summary(reports: list[NodeReport], world_size: int, seconds: float, size: int, took: float):
    """The line rank 0 logs: the checks that ran on some node, in their fixed order, and the
    all-reduce's bandwidth where there was an all-reduce (more than one rank)."""
    nodes = len({r.host for r in reports})
    ran = {name for r in reports for name in r.checked}
    checks = ", ".join(n for n in ("gpus", "gemm", "disk", "env") if n in ran)
    line = f"preflight: {nodes} node{'s' * (nodes != 1)} passed ({checks})"
    if world_size > 1:
        bus = 2 * (world_size - 1) / world_size * size / max(seconds, 1e-9)
        line += (
            f"; all-reduce of {size / 2**20:.0f} MiB over {world_size} ranks: "
            f"{seconds * 1e3:.1f} ms, bus bandwidth {bus / 1e9:.2f} GB/s"
        )
    return f"{line}; preflight took {took:.2f} s"


def allreduce_seconds(megabytes: int, info) -> tuple[float, int]:
    import torch
    import torch.distributed as dist

    numel = max(1, megabytes * 2**20 // 4)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0, numel * 4
    tensor = torch.ones(numel, dtype=torch.float32, device=info.device)
    dist.all_reduce(tensor)  # warm-up: connections are set up on first use
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    start = time.perf_counter()
    dist.all_reduce(tensor)
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    seconds = time.perf_counter() - start
    if float(tensor[0]) != float(info.world_size) ** 2:
        raise PreflightFailed(
            f"preflight: all-reduce gave {float(tensor[0])}, expected {info.world_size**2}",
            EX_PREFLIGHT,
        )
    return seconds, numel * 4
