"""The tests' real Slurm cluster: started once per session (tests/conftest.py offers the fixture
to every test folder: tests/launch and tests/job share it), stopped and purged at the end.

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

HARNESS = Path(__file__).resolve().parent
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
