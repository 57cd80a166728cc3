"""Shard -> test ids, by the real `pytest --collect-only` run the way CI runs it: the shard's own
arguments (pytest's own parser reads them, plugins' options included), from the shard's working
directory, with its environment assignments; ids come from a plugin (plugin.py), not from
parsing pytest's output, so `-q`, `-v` or `addopts` cannot hide them."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

from rlflow import bounded
from rlflow.errors import Diagnostic, RlflowError

IDS_MAX_BYTES = 256 << 20  # the plugin's list of test ids (~100 bytes a test)

# Options that make `--collect-only` collect nothing in this process: xdist hands collection
# to workers (`-n 0` keeps it here).
_WORKERS = ("-n", "--numprocesses", "--dist", "-d", "--tx")


def collect(
    root: Path,
    pytest: list[str],
    args: tuple[str, ...],
    label: str,
    cwd: str = "",
    env: tuple[tuple[str, str], ...] = (),
    notes: list[str] | None = None,
    info: dict | None = None,
    *,
    timeout: float,  # seconds (check-tests' --collect-timeout): then it is stopped, RF202
) -> set[str]:
    """The test ids pytest selects with `args` (-k, -m, paths, --ignore, --deselect...).
    A shard whose own options make pytest run no test (`--co`, `--setup-plan`) selects none:
    then `notes` (when given) gets a line saying so. `info` (when given) gets `modules`, the
    test modules collected, and `python_files`, the configuration's patterns."""
    with tempfile.TemporaryDirectory(prefix="rlflow-check-tests-") as tmp:
        out = Path(tmp) / "ids"
        extra = ["-n", "0"] if any(a.split("=")[0] in _WORKERS for a in args) else []
        command = [
            *pytest,
            *args,
            *extra,
            "--collect-only",
            "-p",
            "rlflow.cicheck.plugin",
            "-o",
            f"cache_dir={tmp}/cache",
        ]
        run_env = {
            **os.environ,
            **{k: v.replace("$GITHUB_WORKSPACE", str(root)) for k, v in env},
            "RLFLOW_CHECK_TESTS_NARGS": str(len(args)),
            "RLFLOW_CHECK_TESTS_OUT": str(out),
            "RLFLOW_CHECK_TESTS_ROOT": str(root),
        }
        where = root / cwd
        if not where.is_dir():
            raise RlflowError(
                Diagnostic("RF201", f"{label} runs in `{cwd}`, which is not a directory")
            )
        try:
            done = _run(command, where, run_env, timeout)
        except subprocess.TimeoutExpired:
            raise RlflowError(
                Diagnostic(
                    "RF202",
                    f"`pytest --collect-only` for {label} did not finish in {timeout:g} s: "
                    "stopped (with every process it started)",
                    help="a conftest.py or test module that waits at import (on a lock, a "
                    "server, input) blocks every CI run too; fix it, or give a slow collection "
                    "more time with --collect-timeout SECONDS",
                )
            ) from None
        except (FileNotFoundError, PermissionError) as err:
            raise RlflowError(
                Diagnostic(
                    "RF202",
                    f"cannot run pytest (`{' '.join(pytest)}`): {err}",
                    help="install pytest in this environment, or pass --pytest 'uv run pytest'",
                )
            ) from None
        if done.returncode not in (0, 5):  # 5: no tests selected, which is an answer too
            tail = [line for line in (done.stdout + done.stderr).strip().splitlines() if line][-8:]
            raise RlflowError(
                Diagnostic(
                    "RF202",
                    f"`pytest --collect-only` failed for {label} (exit {done.returncode})",
                    notes=tuple(tail),
                    help="fix the collection errors above (`pytest --collect-only` shows "
                    "them); a test that does not import is run by no shard either",
                )
            )
        if not out.is_file():
            return set()
        ids = bounded.read_text(out, IDS_MAX_BYTES, timeout, "replace").splitlines()
        ids = [line for line in ids if line]
        if ids and ids[0].startswith("#runs-nothing:") and notes is not None:
            flag = ids[0].split(":", 1)[1].strip()
            notes.append(f"{label} runs no test: its options include `{flag}`")
            return set()
        if info is not None:
            info["modules"] = {i.split(" ", 1)[1] for i in ids if i.startswith("#module: ")}
            patterns = [i.split(" ", 1)[1] for i in ids if i.startswith("#python_files: ")]
            info["python_files"] = patterns[0].split() if patterns else []
            info["deselected"] = {i.split(" ", 1)[1] for i in ids if i.startswith("#deselected: ")}
        return {i for i in ids if not i.startswith("#")}


def _run(command: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run` in a session of its own: on timeout the whole session is killed, so a
    process the collection started (and which holds its output open) cannot keep us waiting."""
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.communicate()
            raise
        finally:
            try:  # what the collection left running (a server a conftest.py started)
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return subprocess.CompletedProcess(command, process.returncode, out, err)
