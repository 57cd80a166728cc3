"""The launch tests' real Slurm cluster: started once per session, stopped and purged at the end.

tests/slurm/start.sh installs Slurm, munge and MariaDB with apt-get on first use (root, Debian
12) and starts 9 slurmd "nodes" (node9 a spare) with 4 fake GPUs each, in a fresh state
directory and on free ports, so it never collides with another cluster on the machine. If it cannot start, every
test that needs it fails with start.sh's own output: the Slurm tests are never skipped.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[1] / "slurm"
NUM_NODES = 9  # node9 is a spare (higher Weight): 8-node jobs get node1-8, retries may use it
SPARE_NODES = 1
GPUS_PER_NODE = 4
START_TIMEOUT_SECONDS = 900  # a fresh machine apt-get installs ~30 packages first
STATE_PREFIX = "rlflow-slurm-"
OWNER_FILE = "owner-pid"  # the pytest process using the cluster


@dataclass(frozen=True)
class Cluster:
    state: Path
    conf: Path


def _ports_free(ports: range) -> bool:
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))  # slurmctld and slurmd listen on every address
            except OSError:
                return False
    return True


def _free_port_block(size: int) -> int:
    """The first port of `size` consecutive free ports, below the ephemeral range."""
    bases = list(range(20000, 32000, size))
    random.shuffle(bases)
    for base in bases:
        if _ports_free(range(base, base + size)):
            return base
    raise RuntimeError("no block of free ports between 20000 and 32000")


def _harness_env(base: int) -> dict[str, str]:
    return {
        **os.environ,
        "SLURM_LOCAL_NODES": str(NUM_NODES),
        "SLURM_LOCAL_SPARE_NODES": str(SPARE_NODES),
        "SLURM_LOCAL_GPUS": str(GPUS_PER_NODE),
        "SLURM_LOCAL_LINK_ETC": "0",  # never touch /etc/slurm: SLURM_CONF is exported instead
        "SLURM_LOCAL_CTLD_PORT": str(base),
        "SLURM_LOCAL_DBD_PORT": str(base + 1),
        "SLURM_LOCAL_DB_PORT": str(base + 2),
        "SLURM_LOCAL_SLURMD_PORT_BASE": str(base + 10),
    }


def _stop(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(HARNESS / "stop.sh"), "--purge", str(state)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _reap_abandoned_clusters() -> None:
    """Stop clusters whose test session was killed before its teardown (its pid is gone)."""
    for state in Path("/tmp").glob(f"{STATE_PREFIX}*"):
        try:
            owner = int((state / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # being set up right now, or not made by this fixture
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            _stop(state)
        except PermissionError:
            pass  # alive, someone else's


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running 9-node cluster (8 + a spare) with SLURM_CONF exported for the whole session."""
    _reap_abandoned_clusters()
    # munged and mysqld must reach the state dir: /tmp, not pytest's 0700 tmp tree.
    state = Path(tempfile.mkdtemp(prefix=STATE_PREFIX, dir="/tmp"))
    state.chmod(0o755)
    (state / OWNER_FILE).write_text(str(os.getpid()))
    base = _free_port_block(NUM_NODES + 12)
    started = subprocess.run(
        ["bash", str(HARNESS / "start.sh"), str(state)],
        env=_harness_env(base),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_SECONDS,
    )
    if started.returncode != 0:
        _stop(state)
        pytest.fail(
            f"the local Slurm cluster did not start (bash tests/slurm/start.sh {state} "
            f"exited {started.returncode}); its output:\n{started.stderr}{started.stdout}",
            pytrace=False,
        )
    conf = state / "etc" / "slurm.conf"
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        yield Cluster(state, conf)
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        stopped = _stop(state)
        assert stopped.returncode == 0, f"tests/slurm/stop.sh failed:\n{stopped.stderr}"


# --- a uv project with pin drift: the root and its submodule pin different git tags ------------

DRIFT_DEP = """\
[project]
name = "dep"
version = "0.1.0"
dependencies = ["emerging-optimizers"]

[tool.uv.sources]
emerging-optimizers = { git = "https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git", rev = "v0.3.0" }
"""

DRIFT_ROOT = """\
[project]
name = "project"
version = "0.1.0"
dependencies = ["dep"]

[tool.uv]
constraint-dependencies = [
    "emerging-optimizers @ git+https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git@v0.2.0",
]

[tool.uv.sources]
dep = { path = "submodules/dep", editable = true }
"""


def git(cwd: Path, *args: str) -> str:
    """git with a fixed identity and no user config; local paths allowed as submodule URLs."""
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    return subprocess.run(
        ["git", "-c", "protocol.file.allow=always", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    for name, text in files.items():
        (path / name).write_text(text)
    git(path, "add", *files)
    git(path, "commit", "-q", "-m", "initial")
    return path


@pytest.fixture
def drift_repo(tmp_path) -> Path:
    """A real git repository whose submodule pins emerging-optimizers v0.3.0 while the root
    constrains v0.2.0 (the incident check-pins exists for)."""
    dep = make_repo(tmp_path / "upstream" / "dep", {"pyproject.toml": DRIFT_DEP})
    root = make_repo(tmp_path / "project", {"pyproject.toml": DRIFT_ROOT})
    git(root, "submodule", "add", "-q", str(dep), "submodules/dep")
    git(root, "commit", "-q", "-m", "add submodules/dep")
    return root
