"""Shard -> test ids, by the real `pytest --collect-only` run the way CI runs it: the shard's own
arguments (pytest's own parser reads them, plugins' options included), from the shard's working
directory, with its environment assignments; ids come from a plugin (plugin.py), not from
parsing pytest's output, so `-q`, `-v` or `addopts` cannot hide them."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError

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
            done = subprocess.run(
                command, cwd=where, env=run_env, capture_output=True, text=True, timeout=1800
            )
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
        ids = [line for line in out.read_text(encoding="utf-8").splitlines() if line]
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
