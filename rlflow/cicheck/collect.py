"""Shard -> test ids, by the real `pytest --collect-only` (in a subprocess, from the repo root)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError


def collect(root: Path, pytest: list[str], args: tuple[str, ...], label: str) -> set[str]:
    """The node ids pytest selects with `args` (-k, -m, paths, --ignore, --deselect...)."""
    command = [*pytest, "--collect-only", "-q", "-p", "no:cacheprovider", *args]
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=1800)
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
                help="fix the collection errors above (`pytest --collect-only` shows them); "
                "a test that does not import is run by no shard either",
            )
        )
    return {
        line.strip()
        for line in done.stdout.splitlines()
        if "::" in line and not line.startswith((" ", "<"))
    }
