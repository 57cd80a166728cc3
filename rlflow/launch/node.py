"""The per-node launcher: start this node's ranks, watch them, end them together.

The batch script runs one of these per node (`srun --ntasks-per-node=1 python -m
rlflow.launch.node ... -- COMMAND`). It starts one process per GPU (per requested rank on
CPU-only nodes) with the torch.distributed environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT), sends each rank's output to
logs/rank-N.log, and watches them:

- a rank exits non-zero: its siblings get SIGTERM, then SIGKILL after a grace; the launcher
  records the first failure and exits with that rank's code, and srun (--kill-on-bad-exit)
  ends every other node. A dead rank never leaves the others waiting in a collective.
- ranks exit 75 (EX_TEMPFAIL: saved and stopped for the time limit): the launcher waits up to
  --stop-grace for its other ranks, leaves a `stopped-node-K` marker and exits 0, so srun
  waits for slower nodes instead of killing them mid-save; the batch script then requeues.
- SIGUSR1 (the time-limit warning) is passed on to every rank, and again every few seconds
  until they exit: ranks start with SIGUSR1 ignored (so an early warning cannot kill a rank
  still importing torch) and hear it once they install a handler. Treat it as a flag; Slurm
  also signals every process of the step. SIGTERM (scancel, the hard limit) is passed on,
  then SIGKILL follows after --stop-grace.

Standard library only, no torch: it must start in a fraction of a second on every node.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

EX_TEMPFAIL = 75  # the trainer's "saved, stopped, please requeue" exit code
EX_PEER_FAILED = 76  # the trainer's "stopped because another rank failed": never the root cause
KILL_GRACE_SECONDS = 10.0  # SIGTERM -> SIGKILL, like Slurm's KillWait
POLL_SECONDS = 0.1
WARNING_REPEAT_SECONDS = 5.0  # a rank that missed the warning (no handler yet) hears it again


class LaunchError(Exception):
    """The launcher cannot start: wrong environment or arguments."""


@dataclass(frozen=True)
class NodeInfo:
    node_rank: int
    num_nodes: int
    ranks_per_node: int
    hostname: str
    master_addr: str
    master_port: str

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.ranks_per_node + local_rank


@dataclass
class Rank:
    rank: int
    local_rank: int
    log_path: Path
    process: subprocess.Popen | None = None
    exit_code: int | None = None  # None while running


def node_info(environ: dict[str, str], num_nodes: int, ranks_per_node: int) -> NodeInfo:
    """This node's place in the job, from the environment srun and the batch script set."""

    def need(name: str) -> str:
        value = environ.get(name, "")
        if not value:
            raise LaunchError(
                f"{name} is not set: the launcher runs under srun inside an rlflow "
                f"job script, which sets it"
            )
        return value

    node_rank = int(need("SLURM_NODEID"))
    step_nodes = int(environ.get("SLURM_STEP_NUM_NODES") or need("SLURM_NNODES"))
    if step_nodes != num_nodes:
        raise LaunchError(
            f"this step runs on {step_nodes} nodes, but the job was planned for "
            f"{num_nodes}: submit again with --nodes {step_nodes}, not by editing the script"
        )
    hostname = environ.get("SLURMD_NODENAME") or socket.gethostname()
    head = environ.get("RLFLOW_HEAD_NODE")
    if node_rank == 0 and head and hostname != head:
        raise LaunchError(
            f"node rank 0 runs on {hostname}, but MASTER_ADDR points at {head}: "
            f"rank 0 would never be found"
        )
    return NodeInfo(
        node_rank, num_nodes, ranks_per_node, hostname, need("MASTER_ADDR"), need("MASTER_PORT")
    )


def rank_environment(base: dict[str, str], info: NodeInfo, local_rank: int) -> dict[str, str]:
    env = dict(base)
    env.update(
        RANK=str(info.global_rank(local_rank)),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_WORLD_SIZE=str(info.ranks_per_node),
        NODE_RANK=str(info.node_rank),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=info.master_port,
    )
    return env


def _ignore_warning_until_handled() -> None:
    """In each rank, before exec: SIGUSR1's default action would kill it; SIG_IGN survives exec
    until the rank installs its own handler."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


# Signals that arrive while this module is still starting (before Launcher.run installs its
# handlers): recorded, not fatal, so an early time-limit warning cannot kill the launcher.
_early_signals: list[int] = []


def _record_early(signum: int, _frame) -> None:
    _early_signals.append(signum)


def exit_code(returncode: int) -> int:
    """Popen's returncode as a shell would report it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


class Launcher:
    def __init__(
        self, info: NodeInfo, command: list[str], log_dir: Path, status_dir: Path, stop_grace: float
    ):
        self.info, self.command, self.stop_grace = info, command, stop_grace
        self.status_dir = status_dir
        self.ranks = [
            Rank(info.global_rank(i), i, log_dir / f"rank-{info.global_rank(i)}.log")
            for i in range(info.ranks_per_node)
        ]
        self.pending_signals: list[int] = []
        self.warned_at: float | None = None  # when SIGUSR1 was last passed on

    def say(self, message: str, stream=sys.stdout) -> None:
        print(
            f"rlflow node {self.info.node_rank} ({self.info.hostname}): {message}",
            file=stream,
            flush=True,
        )

    def run(self) -> int:
        self.status_dir.mkdir(parents=True, exist_ok=True)
        for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, _frame: self.pending_signals.append(s))
        self.pending_signals += _early_signals
        failed = self.start()
        if failed is not None:
            return self.fail(failed)
        self.say(
            f"started ranks {self.ranks[0].rank}-{self.ranks[-1].rank} of "
            f"{self.info.world_size}, rendezvous {self.info.master_addr}:{self.info.master_port}"
        )
        return self.watch()

    def start(self) -> Rank | None:
        """Start every rank; the rank that could not start, if any (the others are stopped)."""
        for rank in self.ranks:
            rank.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(rank.log_path, "ab") as log:
                log.write(
                    f"==== rlflow: rank {rank.rank} on {self.info.hostname}, "
                    f"job {os.environ.get('SLURM_JOB_ID', '?')} attempt "
                    f"{os.environ.get('SLURM_RESTART_COUNT', '0')}, "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode()
                )
                log.flush()
                try:
                    # Own process group: a wrapper (uv run, bash -c) and its children stop together.
                    rank.process = subprocess.Popen(
                        self.command,
                        env=rank_environment(dict(os.environ), self.info, rank.local_rank),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=_ignore_warning_until_handled,
                    )
                except OSError as err:
                    log.write(f"rlflow: cannot run {self.command[0]!r}: {err}\n".encode())
                    rank.exit_code = 127 if isinstance(err, FileNotFoundError) else 126
                    self.stop([r for r in self.ranks if r.process is not None])
                    return rank
        return None

    def watch(self) -> int:
        first_stop: float | None = None
        while True:
            code = self.handle_signals()
            if code is not None:
                return code
            if (
                self.warned_at is not None
                and time.monotonic() - self.warned_at >= WARNING_REPEAT_SECONDS
            ):
                self.warned_at = time.monotonic()
                self.signal_all(self.running(), signal.SIGUSR1)
            for rank in self.running():
                code = rank.process.poll()
                if code is not None:
                    rank.exit_code = exit_code(code)
            failed = [r for r in self.ranks if r.exit_code not in (None, 0, EX_TEMPFAIL)]
            if failed:
                # Ranks that only noticed a dead peer exit 76; report the root failure first.
                failed.sort(key=lambda r: r.exit_code == EX_PEER_FAILED)
                return self.fail(failed[0])
            if not self.running():
                return self.finish()
            if first_stop is None and any(r.exit_code == EX_TEMPFAIL for r in self.ranks):
                first_stop = time.monotonic()
            if first_stop is not None and time.monotonic() - first_stop > self.stop_grace:
                self.say(
                    f"ranks {self.names(self.running())} still run {self.stop_grace:g}s after "
                    f"a rank stopped for a requeue: stopping them"
                )
                self.stop(self.running())
            time.sleep(POLL_SECONDS)

    def handle_signals(self) -> int | None:
        """Act on signals received since the last poll; an exit code when it is time to go."""
        while self.pending_signals:
            signum = self.pending_signals.pop(0)
            if signum == signal.SIGUSR1:
                self.say("time-limit warning (SIGUSR1): passing it on to the ranks")
                self.warned_at = time.monotonic()
                self.signal_all(self.running(), signal.SIGUSR1)
            else:
                # Slurm's own SIGKILL (after KillWait) bounds this; a rank that saves on SIGTERM
                # gets the full grace rather than being cut short here.
                self.say(f"{signal.Signals(signum).name}: stopping the ranks")
                self.stop(self.running(), grace=self.stop_grace)
                return 128 + signum
        return None

    def fail(self, rank: Rank) -> int:
        others = self.running()
        self.say(
            f"rank {rank.rank} exited with code {rank.exit_code}"
            + (f"; stopping ranks {self.names(others)}" if others else ""),
            sys.stderr,
        )
        self.stop(others)
        self.record_failure(rank)
        self.show_log_tail(rank)
        return rank.exit_code

    def finish(self) -> int:
        stopped = [r for r in self.ranks if r.exit_code == EX_TEMPFAIL]
        if stopped:
            self.say(f"ranks {self.names(stopped)} saved and stopped for a requeue (exit 75)")
            (self.status_dir / f"stopped-node-{self.info.node_rank}").write_text(
                f"ranks {self.names(stopped)} on {self.info.hostname} exited 75\n"
            )
        else:
            self.say("all ranks finished")
        return 0

    def record_failure(self, rank: Rank) -> None:
        """The first failure of the job (first writer wins): the batch script's exit code.

        A rank that only saw a peer die (exit 76) is recorded apart, in peer-failure, so a
        node that noticed the death first never hides the node where the error happened."""
        text = (
            f"{rank.exit_code}\nrank {rank.rank} on {self.info.hostname} (node "
            f"{self.info.node_rank}) exited with code {rank.exit_code}; log: {rank.log_path}\n"
        )
        name = "peer-failure" if rank.exit_code == EX_PEER_FAILED else "first-failure"
        try:
            fd = os.open(self.status_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as out:
            out.write(text)

    def show_log_tail(self, rank: Rank, lines: int = 20) -> None:
        try:
            tail = rank.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return
        self.say(f"last lines of {rank.log_path}:", sys.stderr)
        print("\n".join(f"  | {line}" for line in tail), file=sys.stderr, flush=True)

    def stop(self, ranks: list[Rank], grace: float = KILL_GRACE_SECONDS) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds, to each rank's process group."""
        self.signal_all(ranks, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(r.process.poll() is None for r in ranks) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        self.signal_all([r for r in ranks if r.process.poll() is None], signal.SIGKILL)
        for rank in ranks:
            rank.exit_code = exit_code(rank.process.wait())

    def signal_all(self, ranks: list[Rank], signum: int) -> None:
        for rank in ranks:
            try:
                os.killpg(rank.process.pid, signum)
            except ProcessLookupError:
                pass

    def running(self) -> list[Rank]:
        return [r for r in self.ranks if r.process is not None and r.exit_code is None]

    @staticmethod
    def names(ranks: list[Rank]) -> str:
        return ",".join(str(r.rank) for r in ranks)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise LaunchError("no command: put the per-rank command after `--`")
    split = argv.index("--")
    parser = argparse.ArgumentParser(
        prog="python -m rlflow.launch.node", description="Start and watch this node's ranks."
    )
    parser.add_argument("--num-nodes", type=int, required=True)
    parser.add_argument("--ranks-per-node", type=int, required=True)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--status-dir", type=Path, required=True)
    parser.add_argument(
        "--stop-grace",
        type=float,
        required=True,
        help="seconds the other ranks get after one stopped for a requeue",
    )
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        raise LaunchError("no command after `--`")
    return args, command


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGUSR1, _record_early)
    try:
        args, command = parse_args(sys.argv[1:] if argv is None else argv)
        info = node_info(dict(os.environ), args.num_nodes, args.ranks_per_node)
    except LaunchError as err:
        print(f"rlflow node launcher: error: {err}", file=sys.stderr, flush=True)
        return 2
    return Launcher(info, command, args.log_dir, args.status_dir, args.stop_grace).run()


if __name__ == "__main__":
    sys.exit(main())
