"""The vLLM worker as a child process: start, wait until ready, call with deadlines, stop by PID.

Every wait is bounded and watches the process: if the worker dies, the caller gets a
`WorkerError` within a poll interval (about a second), carrying the last lines of the worker's
log (vLLM's own error is usually there), never a hang. The worker has its own process group, so
stopping it ends anything it started too. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections import deque
from pathlib import Path

from rlflow.generation.vllm.worker import recv_message, send_message

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 10.0
LOG_TAIL_LINES = 30


class WorkerError(RuntimeError):
    """The worker failed, died or did not answer in time; the message ends with its log tail."""


class WorkerProcess:
    def __init__(
        self,
        python: Path,
        config: dict,
        log_path: Path,
        env: dict[str, str],
        startup_timeout_s: float,
    ):
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair()
        # -I: isolated from the trainer's PYTHONPATH/user site, and the script's folder (which
        # holds rlflow's own modules) is not put first on sys.path where they could shadow vLLM's.
        argv = [
            str(python),
            "-I",
            "-u",
            str(WORKER_SCRIPT),
            "--fd",
            str(theirs.fileno()),
            "--parent",
            str(os.getpid()),
            "--config",
            json.dumps(config),
        ]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=[theirs.fileno()],
                start_new_session=True,
            )
        theirs.close()  # only the worker holds its end: its death is end-of-file here
        self.sock = ours
        self.pid = self.proc.pid
        try:
            reply = self._receive(startup_timeout_s, "start-up")
            if not reply["ok"]:
                raise WorkerError(self._failure("vLLM failed to start", reply["error"]))
        except WorkerError:
            self.stop()
            raise
        self.info = reply

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, message: dict, timeout_s: float) -> dict:
        """Send one request and wait for its reply; raise WorkerError on any failure."""
        if not self.alive():
            raise WorkerError(
                self._failure(
                    f"the vLLM worker (pid {self.pid}) is not running "
                    f"(exit code {self.proc.returncode})"
                )
            )
        try:
            send_message(self.sock, message)
        except OSError as err:
            raise WorkerError(self._failure(f"could not reach the vLLM worker: {err}")) from None
        reply = self._receive(timeout_s, message["op"])
        if not reply["ok"]:
            raise WorkerError(self._failure(f"vLLM `{message['op']}` failed", reply["error"]))
        return reply

    def _receive(self, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        self.sock.settimeout(POLL_SECONDS)
        while True:
            try:
                # Poll the socket's readiness, not the message: a reply may take longer than one
                # interval to arrive, and a partly read message must not be abandoned.
                self.sock.recv(1, socket.MSG_PEEK)
                break
            except TimeoutError:
                if not self.alive():
                    raise WorkerError(
                        self._failure(
                            f"the vLLM worker (pid {self.pid}) died during "
                            f"{what} (exit code {self.proc.returncode})"
                        )
                    ) from None
                if time.monotonic() > deadline:
                    self.stop(ask_first=False)
                    raise WorkerError(
                        self._failure(
                            f"the vLLM worker gave no answer to {what} within {timeout_s:.0f} s; stopped it "
                            f"(raise generation.vllm.request_timeout_s / startup_timeout_s if it is "
                            f"just slow)"
                        )
                    ) from None
            except OSError:
                break  # a reset connection reads as end-of-file below
        # The rest of the reply must also arrive before the deadline (a stopped worker cannot stall us).
        self.sock.settimeout(max(deadline - time.monotonic(), POLL_SECONDS))
        try:
            reply = recv_message(self.sock)
        except TimeoutError:
            self.stop(ask_first=False)
            raise WorkerError(
                self._failure(
                    f"the vLLM worker's answer to {what} did not finish "
                    f"arriving within {timeout_s:.0f} s; stopped it"
                )
            ) from None
        except OSError:
            reply = None
        if reply is None:
            code = self._wait_exit(5.0)
            raise WorkerError(
                self._failure(
                    f"the vLLM worker (pid {self.pid}) died during {what} (exit code {code})"
                )
            )
        return reply

    def _wait_exit(self, seconds: float) -> int | None:
        try:
            return self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, ask_first: bool = True) -> None:
        """Ask the worker to exit (unless it stopped answering); after a grace, end its process
        group by signal: SIGTERM, then SIGKILL. Idempotent."""
        if self.alive():
            if ask_first:
                try:
                    self.sock.settimeout(STOP_GRACE_SECONDS)
                    send_message(self.sock, {"op": "shutdown"})
                    recv_message(self.sock)
                except OSError:
                    pass
                self._wait_exit(STOP_GRACE_SECONDS)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if self.proc.poll() is not None:
                    break
                self._signal_group(sig)
                self._wait_exit(STOP_GRACE_SECONDS)
        self.sock.close()

    def _signal_group(self, sig: int) -> None:
        # Only while the worker is unreaped: its pid (the group id: it leads its own session)
        # cannot have been reused by an unrelated process yet.
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                return "".join(deque(log, maxlen=lines)).rstrip()
        except OSError:
            return "(no log)"

    def _failure(self, headline: str, error: str | None = None) -> str:
        """The error's last line up front; its traceback tail if it answered, else the log tail."""
        if error:
            last = error.rstrip().splitlines()[-1]
            return (
                f"{headline}: {last}\nworker traceback (end):\n{_last_lines(error, 12)}\n"
                f"full log: {self.log_path}"
            )
        return f"{headline}\nlast lines of {self.log_path}:\n{self.log_tail()}"


def _last_lines(text: str, count: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-count:])
