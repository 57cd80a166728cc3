"""`rlflow train --nproc N`: several ranks on this machine, watched by the same node launcher
that runs them under Slurm (rlflow.job.node), so a failing rank ends the others here too."""

from __future__ import annotations

import socket
from pathlib import Path

from rlflow.errors import EX_TEMPFAIL
from rlflow.job.node import Launcher, NodeInfo


def run_local(
    command: list[str],
    nproc: int,
    run_dir: Path,
    *,
    startup_timeout: float | None,
    stop_signal: str,
) -> int:
    """Start `command` as ranks 0..nproc-1 (rank logs in RUN_DIR/logs); return the exit code:
    75 when the ranks saved and stopped on a time-limit warning, as one rank alone would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    info = NodeInfo(
        node_rank=0,
        num_nodes=1,
        ranks_per_node=nproc,
        hostname=socket.gethostname(),
        master_addr="127.0.0.1",
        master_port=str(port),
    )
    logs = run_dir / "logs"
    launcher = Launcher(
        info,
        command,
        logs,
        logs,
        stop_grace=60.0,
        startup_timeout=startup_timeout,
        stop_signal=stop_signal,
    )
    code = launcher.run()
    print(f"rank logs: {logs}/rank-*.log", flush=True)
    if code == 0 and any(r.exit_code == EX_TEMPFAIL for r in launcher.ranks.all):
        return EX_TEMPFAIL
    return code
