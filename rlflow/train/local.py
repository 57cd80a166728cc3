"""`rlflow train --nproc N`: several ranks on this machine, watched by the same node launcher
that runs them under Slurm (rlflow.job.node), so a failing rank ends the others here too.

A closed terminal (SIGHUP), Ctrl-C (SIGINT) or SIGTERM asks the ranks to save and stop, as the
time-limit warning does under Slurm: they save a checkpoint at the step boundary and exit 75,
and so does `rlflow train`; the same command resumes the run. A second Ctrl-C or SIGTERM stops
the ranks at once, without saving.
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path

from rlflow.errors import EX_TEMPFAIL
from rlflow.job.node import Launcher, NodeInfo
from rlflow.job.ranks import detach_output

SAVE_ON = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGTERM})


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
        save_on=SAVE_ON,
    )
    code = launcher.run()
    try:
        print(f"rank logs: {logs}/rank-*.log", flush=True)
    except OSError:  # the terminal is gone (SIGHUP): the run's files say it all
        detach_output()
    if code == 0 and any(r.exit_code == EX_TEMPFAIL for r in launcher.ranks.all):
        return EX_TEMPFAIL
    return code
