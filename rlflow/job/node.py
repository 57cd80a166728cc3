"""The per-node launcher: start this node's ranks, watch them, end them together.

The batch script runs one per node (`srun --ntasks-per-node=1 python -m rlflow.job.node ...
-- COMMAND`), and `rlflow train --nproc N` one on this machine (rlflow/job/local.py). It
starts one rank per GPU (per requested rank on CPU-only nodes) and watches them until:

- a rank exits non-zero (not 75): its siblings get SIGTERM, then SIGKILL after a grace; the
  launcher records the failure and exits with that rank's code, and srun (--kill-on-bad-exit)
  ends every other node. A dead rank never leaves the others waiting in a collective.
- the ranks exit 75 (EX_TEMPFAIL: saved and stopped for the time limit): the launcher waits up
  to --stop-grace for its other ranks, leaves a `stopped-node-K` marker and exits 0, so srun
  waits for slower nodes instead of killing them mid-save; the batch script then requeues.
- the time-limit warning arrives: it is passed on to every rank (forwarding.py). SIGTERM
  (scancel, the hard limit) is passed on, then SIGKILL follows after --stop-grace. On this
  machine (`rlflow train --nproc`), SIGHUP, SIGTERM and SIGINT are a warning too: a closed
  terminal or Ctrl-C saves and stops the run (exit 75); a second SIGINT or SIGTERM stops it now.
- a rank is silent past its phase's timeout (hangs.py): every local rank's stacks are dumped
  (dumps.py), the hang is recorded with the rank named, and the job ends with exit 77, so the
  batch script can requeue without this node.

The parts: ranks.py (the processes and the reaper), forwarding.py (signals), hangs.py (the hang
watch), dumps.py (stacks), books.py (the status directory and the root-cause rule).
Standard library only, no torch: it must start in a fraction of a second on every node.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

# Standard library only, like this module: 75 saved and stopped, 76 a peer failed, 77 a hang.
from rlflow.errors import EX_HANG, EX_PEER_FAILED, EX_TEMPFAIL
from rlflow.job import files
from rlflow.job.books import Books, root_cause
from rlflow.job.dumps import dump_stacks
from rlflow.job.forwarding import Inbox, WarningRelay, record_early
from rlflow.job.hangs import HangWatch
from rlflow.job.ranks import (
    POLL_SECONDS,
    NodeInfo,
    Rank,
    Ranks,
    describe_exit,
    detach_output,
    names,
    set_parent_death_signal,
)

# A node whose ranks only saw a peer fail (exit 76) waits this long for the failing node to
# record the root cause before its own exit ends the step (srun then stops every node).
PEER_FAILURE_WAIT_SECONDS = 10.0


class LaunchError(Exception):
    """The launcher cannot start: wrong environment or arguments."""


class Launcher:
    def __init__(
        self,
        info: NodeInfo,
        command: list[str],
        log_dir: Path,
        status_dir: Path,
        stop_grace: float,
        *,
        startup_timeout: float | None,  # watchdog.startup_timeout_s; None: no progress needed
        stop_signal: str,  # slurm.stop_signal
        save_on: frozenset[int] = frozenset(),
    ):
        """`save_on`: signals that ask the ranks to save and stop, like the time-limit warning
        (`rlflow train --nproc`: SIGHUP, SIGTERM, SIGINT); under srun, SIGTERM stops them."""
        self.info, self.log_dir, self.stop_grace = info, log_dir, stop_grace
        warning = signal.Signals[f"SIG{stop_signal}"]
        self.ranks = Ranks(info, command, log_dir, status_dir, warning)
        self.books = Books(info, status_dir)
        self.inbox = Inbox({signal.SIGUSR1, warning, signal.SIGTERM, signal.SIGINT, *save_on})
        self.warning = WarningRelay(warning)
        self.save_on, self.saving = save_on, False
        self.stopped_by: str | None = None  # the signal that asked the ranks to stop
        self.hangs = HangWatch(info, status_dir, self.ranks.all, startup_timeout)

    def run(self) -> int:
        self.books.open()
        self.inbox.open()
        self.books.node(files.STARTED, f"{self.info.hostname} pid {os.getpid()}")
        self.ranks.reaper.start()
        code = self.launch_and_watch()
        self.ranks.reaper.stop()
        self.books.node(files.ENDED, f"{self.info.hostname} exit {code}")
        return code

    def launch_and_watch(self) -> int:
        failed = self.ranks.start()
        self.books.keep_alive()
        if failed is not None:
            return self.fail(failed)
        first, last = self.ranks.all[0].rank, self.ranks.all[-1].rank
        self.info.say(
            f"started ranks {first}-{last} of {self.info.world_size}, "
            f"rendezvous {self.info.master_addr}:{self.info.master_port}"
        )
        return self.watch()

    def watch(self) -> int:
        first_stop: float | None = None  # when the first rank exited 75
        while True:
            code = self.handle_signals()
            if code is not None:
                return code
            self.warning.repeat(self.ranks.running())
            hung = self.hangs.check(self.ranks.running())
            if hung is not None:
                return self.hang(*hung)
            self.ranks.poll()
            failed = root_cause(self.ranks.all)
            if failed is not None:
                return self.fail(failed)
            if not self.ranks.running():
                return self.finish()
            if first_stop is None and any(r.exit_code == EX_TEMPFAIL for r in self.ranks.all):
                first_stop = time.monotonic()
            if first_stop is not None and time.monotonic() - first_stop > self.stop_grace:
                self.stop_stragglers()
            time.sleep(POLL_SECONDS)

    def handle_signals(self) -> int | None:
        """Act on signals received since the last poll; an exit code when it is time to go."""
        while self.inbox.pending:
            signum = self.inbox.pending.pop(0)
            if signum in (signal.SIGUSR1, self.warning.signal):
                name = self.stopped_by = signal.Signals(signum).name
                self.info.say(
                    f"time-limit warning ({name}): passing it on to the ranks"
                    + (f" as {self.warning.signal.name}" if signum != self.warning.signal else "")
                )
                self.warning.send(self.ranks.running())
            elif signum in self.save_on and (signum == signal.SIGHUP or not self.saving):
                self.saving = True  # a second SIGINT or SIGTERM (not a HUP) is "stop now"
                self.stopped_by = signal.Signals(signum).name
                self.info.say(
                    f"{signal.Signals(signum).name}: asking the ranks to save and stop "
                    "(SIGINT or SIGTERM again: stop now, without saving)"
                )
                self.warning.send(self.ranks.running())
            else:
                return self.stop_on(signum)
        return None

    def stop_on(self, signum: int) -> int:
        """SIGTERM or SIGINT: stop the ranks and go. Slurm's own SIGKILL (after KillWait) bounds
        this; a rank that saves on SIGTERM gets the full grace rather than being cut short here.
        Recorded first: a node that was told to stop is not a lost node, even if SIGKILL comes
        before the end."""
        name = self.stopped_by = signal.Signals(signum).name
        self.ranks.poll()  # a rank that failed just before srun stopped this node is the cause
        failed = root_cause(self.ranks.all)
        if failed is not None:
            self.books.failure(failed)
        self.books.node(files.ENDED, f"{self.info.hostname} stopping on {name}")
        self.info.say(f"{name}: stopping the ranks")
        self.ranks.stop(self.ranks.running(), grace=self.stop_grace)
        return 128 + signum

    def stop_stragglers(self) -> None:
        running = self.ranks.running()
        self.info.say(
            f"ranks {names(running)} still run {self.stop_grace:g}s after "
            f"a rank stopped for a requeue: stopping them"
        )
        self.ranks.stop(running)

    def hang(self, rank: Rank, silent: float, beat: dict) -> int:
        """Dump every local rank's stacks, record the hang with the rank named, end the job."""
        where = f"rank {rank.rank} ({self.info.hostname})"
        message = (
            f"{where} made no progress for {silent:.0f} s in phase `{beat['phase']}` at step "
            f"{beat.get('step', 0)}"
        )
        running = self.ranks.running()
        self.info.say(f"{message}: dumping the stacks of ranks {names(running)}")
        attempt = files.attempt_of(self.books.status_dir)
        stacks = dump_stacks(self.info, running, self.log_dir, message, attempt)
        message += f"; stacks: {stacks}"
        self.info.say(message, sys.stderr)
        rank.exit_code = EX_HANG
        self.ranks.stop([r for r in self.ranks.running() if r is not rank] + [rank])
        self.books.failure(rank, EX_HANG, message)
        return EX_HANG

    def fail(self, rank: Rank) -> int:
        others = self.ranks.running()
        self.info.say(
            f"rank {rank.rank} {describe_exit(rank.exit_code)}"
            + (f"; stopping ranks {names(others)}" if others else ""),
            sys.stderr,
        )
        show_error(self.info, rank)  # before the siblings' stop, which may take its full grace
        self.ranks.stop(others)
        self.books.failure(rank)
        if rank.exit_code == EX_PEER_FAILED:
            self.wait_for_root_failure()
        return rank.exit_code

    def wait_for_root_failure(self) -> None:
        """Hold this node's exit until another node records why (see PEER_FAILURE_WAIT_SECONDS)."""
        deadline = time.monotonic() + PEER_FAILURE_WAIT_SECONDS
        warnings = (self.warning.signal, signal.SIGUSR1)
        while time.monotonic() < deadline and not self.books.root_failure_recorded():
            if any(s not in warnings for s in self.inbox.pending):
                return  # srun is stopping the step: the root failure was recorded or never will be
            time.sleep(POLL_SECONDS)

    def finish(self) -> int:
        stopped = [r for r in self.ranks.all if r.exit_code == EX_TEMPFAIL]
        if stopped:
            self.info.say(f"ranks {names(stopped)} saved and stopped for a requeue (exit 75)")
            self.books.stopped(stopped)
        else:
            self.info.say("all ranks finished")
        return 0


def show_error(info: NodeInfo, rank: Rank) -> None:
    """The failed rank's own words: its error report from its log (rank.error_report), so the
    reason reaches the terminal or the batch log, not only logs/rank-R.log."""
    report = rank.error_report()
    if not report:
        info.say(
            f"rank {rank.rank} printed nothing before it stopped ({rank.log_path})", sys.stderr
        )
        return
    info.say(f"rank {rank.rank}'s error, from {rank.log_path}:", sys.stderr)
    try:
        print("\n".join(f"  | {line}" for line in report), file=sys.stderr, flush=True)
    except OSError:
        detach_output()


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


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise LaunchError("no command: put the per-rank command after `--`")
    split = argv.index("--")
    parser = argparse.ArgumentParser(
        prog="python -m rlflow.job.node", description="Start and watch this node's ranks."
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
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=None,
        help="seconds a rank may take to send its first progress report (default: no limit)",
    )
    parser.add_argument(
        "--stop-signal",
        choices=["USR1", "HUP"],
        required=True,
        help="the time-limit warning as the ranks hear it (slurm.stop_signal)",
    )
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        raise LaunchError("no command after `--`")
    return args, command


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGUSR1, record_early)
    try:
        args, command = parse_args(sys.argv[1:] if argv is None else argv)
        info = node_info(dict(os.environ), args.num_nodes, args.ranks_per_node)
    except LaunchError as err:
        print(f"rlflow node launcher: error: {err}", file=sys.stderr, flush=True)
        return 2
    # Under srun: slurmstepd gone (a lost node) -> SIGTERM -> stop the ranks, then go. Not for
    # `rlflow train --nproc` (rlflow.job.local), whose parent may be a shell that exits.
    set_parent_death_signal(signal.SIGTERM)
    launcher = Launcher(
        info,
        command,
        args.log_dir,
        args.status_dir,
        args.stop_grace,
        startup_timeout=args.startup_timeout,
        stop_signal=args.stop_signal,
    )
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
