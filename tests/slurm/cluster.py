"""The tests' real Slurm cluster: started once per session (tests/conftest.py offers the fixture
to every test folder: tests/launch and tests/job share it), stopped and purged at the end.

tests/slurm/start.sh installs Slurm, munge and MariaDB with apt-get on first use (root, Debian
12) and starts 9 slurmd "nodes" (node9 a spare) with 4 fake GPUs each, in a fresh state
directory and on free ports, so it never collides with another cluster on the machine. If it cannot start, every
test that needs it fails with start.sh's own output: the Slurm tests are never skipped.

Tests kill, freeze and drain nodes on purpose, so the cluster is checked after every test that
used it (`restore`): leftover jobs are cancelled, a dead slurmd is started again, nodes that are
down or drained are resumed, a controller that leaked GPU counts is restarted, until every node
is idle with no GPU in use. What had to be repaired is a warning naming the test that left it;
a cluster that cannot be repaired fails that test's teardown, and every later Slurm test fails
at once naming it, instead of pending behind a node that never comes back.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
import warnings
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
RESTORE_TIMEOUT_SECONDS = 120  # a restarted slurmd registers in seconds; this is a hang guard


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
def slurm_session():
    """A running 9-node cluster (8 + a spare) with SLURM_CONF exported for the whole session.
    Tests ask for `slurm_cluster` (checked and repaired after each test), not this."""
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


_broken: list[str] = []  # "the test that left the cluster unusable: why", once it happened


@pytest.fixture
def slurm_cluster(slurm_session, request):
    """The session's cluster, healthy at the start of the test and restored after it."""
    if _broken:
        pytest.fail(f"the Slurm cluster is unusable since {_broken[0]}", pytrace=False)
    yield slurm_session
    try:
        repaired = restore(slurm_session)
    except RuntimeError as err:
        _broken.append(f"{request.node.nodeid} left it so: {err}")
        pytest.fail(f"{request.node.nodeid} left the Slurm cluster broken: {err}", pytrace=False)
    if repaired:
        warnings.warn(
            f"{request.node.nodeid} left the Slurm cluster to repair: {'; '.join(repaired)}",
            stacklevel=1,
        )


def restore(cluster: Cluster) -> list[str]:
    """Bring the cluster back to every node idle, no job, no GPU in use; what was repaired.
    RuntimeError if it cannot. A healthy cluster costs three quick Slurm queries."""
    repaired = []
    jobs = _slurm("squeue", "-h", "-o", "%A").split()
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True)
        repaired.append(f"cancelled jobs {','.join(jobs)}")
    for name, (pid, _) in _daemons(cluster).items():
        if _process_state(pid) == "T":  # frozen by a test (SIGSTOP): thaw it
            os.kill(pid, signal.SIGCONT)
            repaired.append(f"continued the stopped {name}")
        if name.startswith("slurmd-") and not alive(pid):
            restart_slurmd(cluster, name.removeprefix("slurmd-"))
            repaired.append(f"restarted {name}")
    states = _node_states()
    down = sorted(n for n, s in states.items() if re.search(r"down|drain|drng|fail|maint", s))
    if down:
        subprocess.run(
            ["scontrol", "update", f"NodeName={','.join(down)}", "State=RESUME"],
            capture_output=True,
        )
        repaired.append(f"resumed {','.join(down)} ({', '.join(states[n] for n in down)})")
    if jobs or down or any(s != "idle" for s in states.values()):
        _wait_idle("after cancelling leftover jobs and resuming nodes")
    leaked = _gres_in_use()
    if leaked:
        # Slurm 22.05 leaks GPU counts when a job whose step it refused on a lost node is
        # requeued ("_step_get_gres_cnt ... node offset invalid"): idle nodes keep GresUsed
        # gpu:1, and a job asking for every GPU there pends forever. A new controller recounts.
        restart_controller(cluster)
        repaired.append(f"restarted slurmctld (GPUs counted in use on idle nodes: {leaked})")
        _wait_idle("after restarting slurmctld")
        if _gres_in_use():
            raise RuntimeError(f"GPUs still counted in use after a controller restart: {leaked}")
    return repaired


def _slurm(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return done.stdout


def _node_states() -> dict[str, str]:
    """node -> sinfo's short state (idle, alloc, down*, drain ...), one per node."""
    lines = _slurm("sinfo", "-h", "-N", "-o", "%N %t").splitlines()
    return dict(line.split() for line in lines if line.strip())


def _gres_in_use() -> str:
    """Nodes where Slurm counts GPUs allocated ("node2 GresUsed=gpu:1(IDX:0)"), empty when
    none is. Called with no job left, so any count is a leak."""
    used = []
    for line in _slurm("scontrol", "show", "node", "-o").splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        gres, tres = fields.get("GresUsed", ""), fields.get("AllocTRES", "")
        if _gpus_counted(gres) or "gres/gpu" in tres:
            used.append(f"{fields.get('NodeName')} GresUsed={gres} AllocTRES={tres}")
    return ", ".join(used)


def _gpus_counted(gres_used: str) -> int:
    """The GPUs in a GresUsed value: gpu:1(IDX:0), gpu:(null):1(IDX:0), gpu:a100:2(IDX:0-1)."""
    total = 0
    for item in re.sub(r"\([^)]*IDX[^)]*\)", "", gres_used).split(","):
        name, _, rest = item.partition(":")
        count = rest.rsplit(":", 1)[-1]
        if name == "gpu" and count.isdigit():
            total += int(count)
    return total


def _wait_idle(when: str) -> None:
    deadline = time.monotonic() + RESTORE_TIMEOUT_SECONDS
    while True:
        jobs = _slurm("squeue", "-h", "-o", "%A %T").split("\n")
        states = _node_states()
        if not any(j.strip() for j in jobs) and states and set(states.values()) == {"idle"}:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"not every node idle {RESTORE_TIMEOUT_SECONDS} s {when}: "
                f"{' '.join(f'{n}={s}' for n, s in states.items())}; jobs: {jobs}"
            )
        time.sleep(0.5)


def _daemons(cluster: Cluster) -> dict[str, tuple[int, str]]:
    """name -> (pid, binary) from STATE/pids (start.sh writes it, stop.sh reads it)."""
    found = {}
    for line in (cluster.state / "pids").read_text().splitlines():
        name, pid, exe = line.split()
        found[name] = (int(pid), exe)
    return found


def _record_daemon(cluster: Cluster, name: str, pid: int, binary: str) -> None:
    """Replace `name`'s line in STATE/pids, so stop.sh stops the new process."""
    pids = cluster.state / "pids"
    lines = [
        f"{name} {pid} {os.path.realpath(binary)}" if line.startswith(f"{name} ") else line
        for line in pids.read_text().splitlines()
    ]
    pids.write_text("\n".join(lines) + "\n")


def daemon_pid(cluster: Cluster, name: str) -> int:
    """The pid of one of the cluster's daemons: "slurmd-node2", "slurmctld"."""
    daemons = _daemons(cluster)
    assert name in daemons, f"no {name} in {cluster.state / 'pids'}"
    return daemons[name][0]


def _process_state(pid: int) -> str:
    """The process's state letter (R, S, T, Z ...), or "" when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    return _process_state(pid) not in ("", "Z", "X")


def restart_slurmd(cluster: Cluster, node: str) -> None:
    """The node comes back (a reboot): a fresh slurmd, recorded where stop.sh finds it."""
    log = (cluster.state / "log" / f"slurmd-{node}.out").open("ab")
    daemon = subprocess.Popen(
        ["/usr/sbin/slurmd", "-D", "-N", node, "-f", str(cluster.conf)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    _record_daemon(cluster, f"slurmd-{node}", daemon.pid, "/usr/sbin/slurmd")


def restart_controller(cluster: Cluster) -> None:
    """A fresh slurmctld (same state directory), as an admin would after a node loss."""
    old = daemon_pid(cluster, "slurmctld")
    os.kill(old, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while alive(old):
        if time.monotonic() > deadline:
            raise RuntimeError("slurmctld did not stop within 30 s of SIGTERM")
        time.sleep(0.2)
    log = (cluster.state / "log" / "slurmctld.out").open("ab")
    daemon = subprocess.Popen(
        ["/usr/sbin/slurmctld", "-D", "-f", str(cluster.conf)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    _record_daemon(cluster, "slurmctld", daemon.pid, "/usr/sbin/slurmctld")
    deadline = time.monotonic() + 60
    while subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the restarted slurmctld does not answer `scontrol ping`")
        time.sleep(0.2)
