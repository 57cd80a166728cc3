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
- SIGUSR1 (the time-limit warning) is passed on to every rank (as slurm.stop_signal), and
  again every few seconds to those that ignored it: ranks start with it ignored (so an early
  warning cannot kill a rank still importing torch) and hear it once they install a handler.
  A rank that had a handler, or said it heard the warning, never gets it twice: a second one
  during its exit would kill it. Treat it as a flag. SIGTERM (scancel, the hard limit) is
  passed on,
  then SIGKILL follows after --stop-grace.

- progress: every rank reports (phase, step, time) to a heartbeat file (rlflow/train/watchdog.py).
  A rank silent past its phase's timeout is hung: every local rank dumps its Python stacks
  (faulthandler, on SIGUSR2) into its log, the launcher collects them into logs/hang-*.txt,
  records "rank R (host) made no progress for S s in phase P at step N" and ends the job (exit
  77), so the batch script can requeue without this node.
- the ranks never outlive the launcher: each has PR_SET_PDEATHSIG(SIGKILL), and a small reaper
  process kills their process groups (wrappers' children too) when the launcher dies, even of
  SIGKILL; under srun the launcher itself gets SIGTERM when its parent (slurmstepd) dies.
- node-K.started / node-K.ended in the status directory: a node that started and never ended
  was lost (the batch script's retry decision, rlflow/launch/attempts.py, reads them).

Standard library only, no torch: it must start in a fraction of a second on every node.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Standard library only, like this module: 75 saved and stopped, 76 a peer failed, 77 a hang.
from rlflow.errors import EX_HANG, EX_PEER_FAILED, EX_TEMPFAIL

DUMP_SIGNAL = signal.SIGUSR2  # rlflow/train/watchdog.py: faulthandler dumps every stack
DUMP_WAIT_SECONDS = 5.0  # for the ranks' stack dumps to reach their logs
HEARTBEAT_POLL_SECONDS = 1.0
# A rank on another node silent this much longer (wall clock) is the likelier root cause: its
# launcher names it, while this one waits up to DEFER_SECONDS before naming its own rank.
DEFER_MARGIN_SECONDS = 1.0
DEFER_SECONDS = 20.0
PR_SET_PDEATHSIG = 1
KILL_GRACE_SECONDS = 10.0  # SIGTERM -> SIGKILL, like Slurm's KillWait
# A node whose ranks only saw a peer fail (exit 76) waits this long for the failing node to
# record the root cause before its own exit ends the step (srun then stops every node).
PEER_FAILURE_WAIT_SECONDS = 10.0
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
    heartbeat_path: Path
    process: subprocess.Popen | None = None
    exit_code: int | None = None  # None while running
    started_at: float = 0.0  # CLOCK_MONOTONIC
    missed_warning: bool = False  # the last warning found the signal ignored (still starting)

    def heartbeat(self) -> dict | None:
        """The rank's last progress report, or None before its first."""
        try:
            return json.loads(self.heartbeat_path.read_text())
        except (OSError, ValueError):
            return None


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


def _set_parent_death_signal(signum: int) -> None:
    """Linux: deliver `signum` to this process when its parent dies (survives exec)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the reaper alone covers it


def _rank_preexec(stop_signal: int):
    def preexec() -> None:
        """In each rank, before exec: the warning's and the dump signal's default action would
        kill it (or a wrapper such as `uv run`); SIG_IGN survives exec until the rank installs
        its own handlers. The rank dies with the launcher."""
        for signum in {signal.SIGUSR1, stop_signal, DUMP_SIGNAL}:
            signal.signal(signum, signal.SIG_IGN)
        _set_parent_death_signal(signal.SIGKILL)

    return preexec


# The reaper: a separate process holding a pipe from the launcher. At EOF (the launcher ended,
# however it ended) it kills every process group it was told about, unless told "done".
_REAPER = """
import os, signal, sys
groups, done = [], False
for line in sys.stdin:
    line = line.strip()
    if line == "done":
        done = True
        break
    if line.isdigit():
        groups.append(int(line))
if not done:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except OSError:
                pass
        if sig == signal.SIGTERM:
            import time; time.sleep(2)
"""


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
        self,
        info: NodeInfo,
        command: list[str],
        log_dir: Path,
        status_dir: Path,
        stop_grace: float,
        startup_timeout: float | None = None,
        stop_signal: str = "USR1",
    ):
        self.info, self.command, self.stop_grace = info, command, stop_grace
        self.status_dir, self.log_dir = status_dir, log_dir
        self.startup_timeout = startup_timeout  # None: a rank need not report progress
        self.stop_signal_name = stop_signal
        self.stop_signal = signal.Signals[f"SIG{stop_signal}"]
        beats = status_dir / "heartbeat"
        self.ranks = [
            Rank(
                info.global_rank(i),
                i,
                log_dir / f"rank-{info.global_rank(i)}.log",
                beats / f"rank-{info.global_rank(i)}.json",
            )
            for i in range(info.ranks_per_node)
        ]
        self.pending_signals: list[int] = []
        self.warned_at: float | None = None  # when the warning was last passed on
        self.reaper: subprocess.Popen | None = None
        self.next_heartbeat_check = 0.0
        self.deferred_since: float | None = None

    def say(self, message: str, stream=sys.stdout) -> None:
        print(
            f"rlflow node {self.info.node_rank} ({self.info.hostname}): {message}",
            file=stream,
            flush=True,
        )

    def run(self) -> int:
        self.status_dir.mkdir(parents=True, exist_ok=True)
        (self.status_dir / "heartbeat").mkdir(exist_ok=True)
        for signum in {signal.SIGUSR1, self.stop_signal, signal.SIGTERM, signal.SIGINT}:
            signal.signal(signum, lambda s, _frame: self.pending_signals.append(s))
        self.pending_signals += _early_signals
        self.record_node("started", f"{self.info.hostname} pid {os.getpid()}")
        self.start_reaper()
        code = self.launch_and_watch()
        self.stop_reaper()
        self.record_node("ended", f"{self.info.hostname} exit {code}")
        return code

    def launch_and_watch(self) -> int:
        failed = self.start()
        if failed is not None:
            return self.fail(failed)
        self.say(
            f"started ranks {self.ranks[0].rank}-{self.ranks[-1].rank} of "
            f"{self.info.world_size}, rendezvous {self.info.master_addr}:{self.info.master_port}"
        )
        return self.watch()

    def record_node(self, event: str, text: str) -> None:
        try:
            (self.status_dir / f"node-{self.info.node_rank}.{event}").write_text(text + "\n")
        except OSError:
            pass

    def start_reaper(self) -> None:
        try:
            self.reaper = subprocess.Popen(
                [sys.executable, "-c", _REAPER],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                text=True,
            )
        except OSError as err:
            self.say(f"no reaper ({err}): ranks rely on PR_SET_PDEATHSIG alone", sys.stderr)

    def tell_reaper(self, line: str) -> None:
        if self.reaper is None:
            return
        try:
            self.reaper.stdin.write(line + "\n")
            self.reaper.stdin.flush()
        except (OSError, ValueError):
            pass

    def stop_reaper(self) -> None:
        if self.reaper is not None:
            self.tell_reaper("done")
            try:
                self.reaper.stdin.close()
                self.reaper.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass

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
                env = rank_environment(dict(os.environ), self.info, rank.local_rank)
                env["RLFLOW_HEARTBEAT_FILE"] = str(rank.heartbeat_path)
                env["RLFLOW_STOP_SIGNAL"] = self.stop_signal_name
                rank.heartbeat_path.unlink(missing_ok=True)  # a previous attempt's report
                rank.started_at = time.monotonic()
                try:
                    # Own process group: a wrapper (uv run, bash -c) and its children stop together.
                    rank.process = subprocess.Popen(
                        self.command,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=_rank_preexec(self.stop_signal),
                    )
                    self.tell_reaper(str(rank.process.pid))
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
                # Only to ranks that ignored it (no handler yet) and have not said they heard it:
                # a rank that is saving and exiting must not get it again (signals.py).
                self.warned_at = time.monotonic()
                self.warn([r for r in self.unwarned() if r.missed_warning])
            if time.monotonic() >= self.next_heartbeat_check:
                self.next_heartbeat_check = time.monotonic() + HEARTBEAT_POLL_SECONDS
                hung = self.find_hung()
                if hung is not None and not self.defer_to_other_node(hung[2]):
                    return self.hang(*hung)
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
            if signum in (signal.SIGUSR1, self.stop_signal):
                name = signal.Signals(signum).name
                self.say(
                    f"time-limit warning ({name}): passing it on to the ranks"
                    + (f" as {self.stop_signal.name}" if signum != self.stop_signal else "")
                )
                self.warned_at = time.monotonic()
                self.warn(self.running())
            else:
                # Slurm's own SIGKILL (after KillWait) bounds this; a rank that saves on SIGTERM
                # gets the full grace rather than being cut short here. Recorded first: a node
                # that was told to stop is not a lost node, even if SIGKILL comes before the end.
                name = signal.Signals(signum).name
                self.record_exited_failures()
                self.record_node("ended", f"{self.info.hostname} stopping on {name}")
                self.say(f"{name}: stopping the ranks")
                self.stop(self.running(), grace=self.stop_grace)
                return 128 + signum
        return None

    def warn(self, ranks: list[Rank]) -> None:
        """The time-limit warning to `ranks`, noting which of them ignore it for now."""
        for rank in ranks:
            pid = (rank.heartbeat() or {}).get("pid") or rank.process.pid
            rank.missed_warning = _ignores(pid, self.stop_signal)
        self.signal_all(ranks, self.stop_signal)

    def unwarned(self) -> list[Rank]:
        return [r for r in self.running() if not (r.heartbeat() or {}).get("stop_requested")]

    def find_hung(self) -> tuple[Rank, float, dict] | None:
        """The rank silent longest past its phase's timeout: (rank, seconds silent, report)."""
        now = time.monotonic()
        late = []
        for rank in self.running():
            beat = rank.heartbeat()
            if beat is None:
                if self.startup_timeout is None:
                    continue  # a command that does not report progress (smoke tests)
                beat = {"phase": "startup", "step": 0, "time": rank.started_at}
                limit = self.startup_timeout
            else:
                limit = beat.get("timeout_s")
            if limit is not None and now - beat["time"] > limit:
                late.append((now - beat["time"], rank, beat))
        if not late:
            return None
        silent, rank, beat = max(late, key=lambda item: item[0])
        return rank, silent, beat

    def defer_to_other_node(self, beat: dict) -> bool:
        """Every rank stops reporting once one is stuck (the others wait in a collective), so
        each node's launcher sees its own ranks go silent. The one silent longest across the
        job is the root cause: if it is on another node, leave the naming to that node's
        launcher (for at most DEFER_SECONDS: that node may be gone)."""
        if (self.status_dir / "first-failure").exists():
            return True  # another node has named the cause; srun ends this node next
        mine = beat.get("wall")
        if mine is None:
            return False
        local = {r.heartbeat_path.name for r in self.ranks}
        now = time.time()
        for path in (self.status_dir / "heartbeat").glob("rank-*.json"):
            if path.name in local:
                continue
            try:
                other = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            limit, wall = other.get("timeout_s"), other.get("wall")
            if limit is None or wall is None:
                continue
            if wall < mine - DEFER_MARGIN_SECONDS and now - wall > limit:
                if self.deferred_since is None:
                    self.deferred_since = time.monotonic()
                    self.say(f"a rank on another node is silent longer ({path.name}): waiting")
                return time.monotonic() - self.deferred_since < DEFER_SECONDS
        return False

    def hang(self, rank: Rank, silent: float, beat: dict) -> int:
        """Dump every local rank's stacks, record the hang with the rank named, end the job."""
        where = f"rank {rank.rank} ({self.info.hostname})"
        message = (
            f"{where} made no progress for {silent:.0f} s in phase `{beat['phase']}` at step "
            f"{beat.get('step', 0)}"
        )
        self.say(f"{message}: dumping the stacks of ranks {self.names(self.running())}")
        stacks = self.dump_stacks(message)
        message += f"; stacks: {stacks}"
        self.say(message, sys.stderr)
        rank.exit_code = EX_HANG
        self.stop([r for r in self.running() if r is not rank] + [rank])
        self.record_failure(rank, EX_HANG, message)
        return EX_HANG

    def dump_stacks(self, headline: str) -> Path:
        """SIGUSR2 to every running rank; their faulthandler dumps land in the rank logs and are
        copied to one hang file. A stopped rank (SIGSTOP, state T) gets SIGCONT only once the
        others have dumped, so their stacks show where they waited, not where they went next."""
        ranks = self.running()
        offsets = {r.rank: _size(r.log_path) for r in ranks}
        pids = {r.rank: (r.heartbeat() or {}).get("pid") or r.process.pid for r in ranks}
        states = {r.rank: _process_state(pids[r.rank]) for r in ranks}
        for rank in ranks:
            _kill(pids[rank.rank], DUMP_SIGNAL)
        stopped = [r for r in ranks if states[r.rank] == "T"]
        self.wait_for_dumps([r for r in ranks if r not in stopped], offsets)
        for rank in stopped:
            _kill(pids[rank.rank], signal.SIGCONT)
        self.wait_for_dumps(stopped, offsets)
        attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
        path = self.log_dir / f"hang-attempt{attempt}-node{self.info.node_rank}.txt"
        parts = [f"rlflow watchdog: {headline}\n"]
        for rank in ranks:
            state = states[rank.rank]
            parts.append(
                f"\n==== rank {rank.rank} (pid {pids[rank.rank]}, process state {state}), "
                f"from {rank.log_path} ====\n"
            )
            parts.append(_read_from(rank.log_path, offsets[rank.rank]) or "(no dump arrived)\n")
        try:
            path.write_text("".join(parts))
        except OSError as err:
            self.say(f"cannot write {path}: {err}", sys.stderr)
        return path

    @staticmethod
    def wait_for_dumps(ranks: list[Rank], offsets: dict[int, int]) -> None:
        """Until every rank's log has grown and stopped growing (at most DUMP_WAIT_SECONDS)."""
        deadline = time.monotonic() + DUMP_WAIT_SECONDS
        sizes: dict[int, int] = {}
        while ranks and time.monotonic() < deadline:
            time.sleep(0.5)
            now = {r.rank: _size(r.log_path) for r in ranks}
            if all(now[k] > offsets[k] for k in now) and now == sizes:
                return
            sizes = now

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
        if rank.exit_code == EX_PEER_FAILED:
            self.wait_for_root_failure()
        return rank.exit_code

    def record_exited_failures(self) -> None:
        """A rank that failed just before srun stopped this node is still the root cause: the
        node polls every 0.1 s, and srun's SIGTERM can come in between."""
        for rank in self.running():
            code = rank.process.poll()
            if code is not None:
                rank.exit_code = exit_code(code)
        failed = [r for r in self.ranks if r.exit_code not in (None, 0, EX_TEMPFAIL)]
        failed.sort(key=lambda r: r.exit_code == EX_PEER_FAILED)
        if failed:
            self.record_failure(failed[0])

    def wait_for_root_failure(self) -> None:
        """Hold this node's exit until another node records why (see PEER_FAILURE_WAIT_SECONDS)."""
        deadline = time.monotonic() + PEER_FAILURE_WAIT_SECONDS
        while time.monotonic() < deadline and not (self.status_dir / "first-failure").exists():
            if any(s != self.stop_signal and s != signal.SIGUSR1 for s in self.pending_signals):
                return  # srun is stopping the step: the root failure was recorded or never will be
            time.sleep(POLL_SECONDS)

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

    def record_failure(self, rank: Rank, code: int | None = None, message: str = "") -> None:
        """The first failure of the job (first writer wins): the batch script's exit code.

        Line 1: the exit code; line 2: what happened; line 3: the node's name (the retry
        decision excludes it for a hang or a failed preflight). A rank that only saw a peer
        die (exit 76) is recorded apart, in peer-failure, so a node that noticed the death
        first never hides the node where the error happened."""
        code = rank.exit_code if code is None else code
        if not message:
            note = (rank.heartbeat() or {}).get("note")
            message = (
                f"rank {rank.rank} on {self.info.hostname} (node {self.info.node_rank}) "
                + (f"{note}" if note else f"exited with code {code}")
                + f"; log: {rank.log_path}"
            )
        text = f"{code}\n{message}\n{self.info.hostname}\n"
        try:  # every node's own failure too: a preflight may fail on several nodes at once
            (self.status_dir / f"failure-node-{self.info.node_rank}").write_text(text)
        except OSError:
            pass
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


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def _ignores(pid: int, signum: int) -> bool:
    """Whether `pid` ignores `signum` right now (/proc SigIgn); True where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) >> (int(signum) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True


def _process_state(pid: int) -> str:
    """R running, S sleeping, T stopped (SIGSTOP), D uninterruptible I/O, Z exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


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
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=None,
        help="seconds a rank may take to send its first progress report (default: no limit)",
    )
    parser.add_argument(
        "--stop-signal",
        choices=["USR1", "HUP"],
        default="USR1",
        help="the time-limit warning as the ranks hear it",
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
    # Under srun: slurmstepd gone (a lost node) -> SIGTERM -> stop the ranks, then go. Not for
    # `rlflow train --nproc` (rlflow.train.local), whose parent may be a shell that exits.
    _set_parent_death_signal(signal.SIGTERM)
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
