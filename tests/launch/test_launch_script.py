"""The rendered sbatch script, run by bash: quoting and the script's own logic (warnings,
requeue), with srun and scontrol stubbed because pyxis and remote nodes do not exist here.
The same script runs under real Slurm in test_launch_slurm.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from datetime import datetime
from pathlib import Path

from rlflow.launch.plan import SubmitFlags
from rlflow.launch.prepare import prepare
from tests.slurm.jobs import PYTHON, RECIPES, write_recipe

HOSTILE = 'x"; touch /tmp/pwned; "'

STUB_SRUN = """#!/bin/bash
# Stands in for srun: record the exact argv (NUL-separated), then run the command on this
# machine as the job's only node. STUB_WARN_SETUP=1: Slurm's time-limit warning reaches the
# batch script while the setup step runs.
printf '%s\\0' "$@" >"$STUB_LOG/srun-$(date +%s%N)"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
if [[ ${STUB_WARN_SETUP:-0} == 1 && $1 == bash ]]; then kill -USR1 "$PPID"; sleep 0.5; fi
export SLURM_NODEID=0 SLURM_NNODES=1 SLURM_STEP_NUM_NODES=1 SLURMD_NODENAME=node1
exec "$@"
"""

STUB_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=node1 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=localhost" ;;
  "requeue "*) echo "$2" >>"$STUB_LOG/requeued" ;;
  "update JobId="*) echo "$*" >>"$STUB_LOG/updated" ;;
  *) echo "unexpected scontrol $*" >&2; exit 1 ;;
esac
"""


def run_script(tmp_path: Path, recipe: Path, command: str, srun: str = STUB_SRUN, **env: str):
    """Render `recipe` for 1 node x 1 rank (every check runs, bash -n included) and run the
    script with bash; the finished process, the srun calls' argv lists and the plan."""
    prepared = prepare(
        recipe,
        (),
        SubmitFlags(nodes=1, gpus=1, command=command),
        skip_pins=True,
        cwd=str(tmp_path),
        now=datetime(2026, 1, 2, 3, 4, 5),
        token="abcdef",
    )
    script = tmp_path / "script.sbatch"
    script.write_text(prepared.script)
    stubs = tmp_path / "stub-bin"
    stubs.mkdir()
    for name, text in (("srun", srun), ("scontrol", STUB_SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    stub_log = tmp_path / "stub-log"
    stub_log.mkdir()
    full_env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUB_LOG": str(stub_log),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        **env,
    }
    ran = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    calls = [p.read_text().split("\0")[:-1] for p in sorted(stub_log.glob("srun-*"))]
    return ran, calls, prepared.plan


def test_hostile_values_stay_single_words_when_bash_runs_the_script(tmp_path):
    """Job name, env values, container image and mounts, the setup command and the rank
    command, each carrying `x"; touch /tmp/pwned; "` or `$(id)`: rendered, `bash -n`-checked
    (prepare runs every check), then executed by bash, with srun/scontrol stubbed (no pyxis
    here). Each value reaches srun or the rank as exactly the word it was."""
    canary = Path("/tmp/pwned")
    canary.unlink(missing_ok=True)
    setup = "echo x\"; touch /tmp/pwned; \" '$(id)'"
    recipe = write_recipe(
        tmp_path / "hostile.yaml",
        {
            "run": {"name": HOSTILE, "output_dir": 'it\'s a "dir"; $(id)'},
            "slurm": {
                "env": {"HOSTILE": HOSTILE, "SUBST": "$(id)"},
                "container_image": HOSTILE,
                "container_mounts": [f"{HOSTILE}:/a", "$(id):/b"],
                "extra_sbatch_args": [f"--comment={HOSTILE}"],
                "setup_command": setup,
            },
        },
    )
    probe = "import os, sys; print(sys.argv[1:], repr(os.environ['HOSTILE']), repr(os.environ['SUBST']))"
    ran, (setup_call, launch_call), plan = run_script(
        tmp_path, recipe, shlex.join([PYTHON, "-c", probe, HOSTILE, "$(id)"])
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert not canary.exists()
    pyxis = [
        "--nodes=1",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        f"--container-image={HOSTILE}",
        "--container-name=rlflow",
        f"--container-mounts={HOSTILE}:/a,$(id):/b",
    ]
    assert setup_call == [*pyxis, "bash", "-c", setup]
    assert launch_call[: len(pyxis) + 3] == [*pyxis, PYTHON, "-m", "rlflow.job.node"]
    assert launch_call[launch_call.index("--") + 1 :] == [PYTHON, "-c", probe, HOSTILE, "$(id)"]
    assert "x; touch /tmp/pwned;  $(id)" in ran.stdout.splitlines()  # the setup ran as written
    rank_log = Path(plan.log_dir) / "rank-0.log"
    assert rank_log.read_text().splitlines()[1] == f"{[HOSTILE, '$(id)']} {HOSTILE!r} '$(id)'"
    assert Path(plan.run_dir).parent == tmp_path / 'it\'s a "dir"; $(id)'


def test_a_warning_during_setup_spares_the_setup_and_requeues_before_the_ranks_start(tmp_path):
    recipe = write_recipe(
        tmp_path / "setup.yaml",
        {"slurm": {"setup_command": "echo setup done"}},
        defaults=RECIPES / "tiny-cpu.yaml",
    )
    ran, calls, _ = run_script(tmp_path, recipe, "touch ranks-ran", STUB_WARN_SETUP="1")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "setup done" in ran.stdout.splitlines()  # the setup step was not killed by the warning
    assert [call[-3:] for call in calls] == [["bash", "-c", "echo setup done"]]  # no rank step
    assert (tmp_path / "stub-log" / "requeued").read_text() == "4242\n"
    assert "requeueing: attempt 1 continues the run (slurm.max_requeues=1)" in ran.stdout
    assert not (tmp_path / "ranks-ran").exists()


def test_the_script_exits_with_the_first_failing_ranks_code(tmp_path):
    ran, calls, plan = run_script(tmp_path, RECIPES / "tiny-cpu.yaml", "bash -c 'exit 9'")
    assert ran.returncode == 9
    assert "rlflow: failed: rank 0 on node1 (node 0) exited with code 9" in ran.stdout
    assert (
        (Path(plan.run_dir) / "status" / "attempt-0" / "first-failure")
        .read_text()
        .startswith("9\n")
    )


# srun of a two-node step whose second node was told to stop (its launcher recorded "stopping
# on SIGTERM") and then died before recording its exit: its counter stops, and srun waits for
# the node forever, as real srun does until Slurm declares the node down.
SRUN_LOSING_A_STOPPING_NODE = """#!/bin/bash
for arg in "$@"; do [[ $arg == --status-dir=* ]] && status=${arg#--status-dir=}; done
echo "node1 pid 1" >"$status/node-0.started"
echo "node2 pid 2" >"$status/node-1.started"
echo 3 >"$status/node-1.alive"
echo "node2 stopping on SIGTERM" >"$status/node-1.ended"
echo "node1 exit 0" >"$status/node-0.ended"
exec sleep 600
"""


def test_a_node_lost_while_stopping_is_found_lost_and_the_job_requeues_without_it(tmp_path):
    """CI once hung here under real Slurm: node2's launcher heard a SIGTERM, recorded that it
    was stopping, and died; the watcher took the record for an end and srun waited for node2.
    A launcher that has not recorded its exit is watched until it does."""
    ran, _, plan = run_script(
        tmp_path, RECIPES / "tiny-cpu.yaml", "true", srun=SRUN_LOSING_A_STOPPING_NODE
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "the launcher of node-1 has shown no sign of life for 15 s" in ran.stdout
    assert "requeueing without nodes node2" in ran.stdout
    status = Path(plan.run_dir) / "status" / "attempt-0"
    assert (status / "node-1.lost").read_text() == "node2 no sign of life for 15 s\n"
    [record] = [json.loads(line) for line in (Path(plan.run_dir) / "attempts.jsonl").open()]
    assert (record["outcome"], record["bad_nodes"]) == ("node-failure", ["node2"])
    assert "JobId=4242 ExcNodeList=node2" in (tmp_path / "stub-log" / "updated").read_text()
