"""Sweeps (`rlflow submit --sweep`), GPU-hours up front and their cap.

The parsing and cost tests need no Slurm. The others submit real job arrays to the local
cluster (conftest.py) through the real `rlflow` console script, and check them with
`rlflow status` / `rlflow cancel` and Slurm's own squeue, scontrol and sacct.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.launch import sweep, sweep_jobs
from tests.slurm.jobs import (
    PYTHON,
    RECIPES,
    REPO,
    assert_printed,
    batch_log,
    job_fields,
    payload_command,
    wait_for_files,
)

RLFLOW = Path(PYTHON).parent / "rlflow"  # the console script users run
TINY = RECIPES / "tiny-cpu.yaml"
TINY_TRAIN = REPO / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RLFLOW), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def submit_sweep(*args: str, cwd: Path) -> tuple[str, Path]:
    """`rlflow submit --sweep ...` for real; the array's job id and the sweep directory."""
    result = cli("submit", *args, cwd=cwd)
    assert result.returncode == 0, f"rlflow submit failed:\n{result.stdout}\n{result.stderr}"
    array = re.search(r"submitted sweep as job array (\d+)", result.stdout)[1]
    return array, Path(re.search(r"sweep dir: (.*)", result.stdout)[1].strip())


def task_states(array: str) -> dict[str, str]:
    """Task id (ARRAY_INDEX) -> state: sacct for ended tasks, squeue -r for live ones (sacct
    lags behind). Tasks not started yet share one sacct record (ARRAY_[2-3%2]), split here."""
    states = {}
    ended = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", array, "-o", "JobID,State"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    live = subprocess.run(
        ["squeue", "-h", "-r", "-j", array, "-o", "%i|%T"], capture_output=True, text=True
    ).stdout  # exit 1 once Slurm has forgotten the array
    for line in (ended + live).splitlines():
        job, state = line.split("|")[:2]
        pending = re.fullmatch(rf"{array}_\[(\d+)(?:-(\d+))?(?:%\d+)?\]", job)
        if pending:
            for index in range(int(pending[1]), int(pending[2] or pending[1]) + 1):
                states[f"{array}_{index}"] = state.split()[0]
        else:
            states[job] = state.split()[0]
    return states


def wait_all(array: str, count: int, states: set[str], timeout: float) -> dict[str, str]:
    """Until every one of the array's `count` tasks is in `states` (a hang guard, not a speed
    check: the timeout fails the test with what sacct says)."""
    deadline = time.monotonic() + timeout
    while True:
        found = task_states(array)
        tasks = {k: v for k, v in found.items() if re.fullmatch(rf"{array}_\d+", k)}
        if len(tasks) == count and set(tasks.values()) <= states:
            return tasks
        if time.monotonic() > deadline:
            pytest.fail(f"job array {array} did not reach {sorted(states)}: {found}")
        time.sleep(1)


# --- without Slurm: axes, names, matrix, cost -----------------------------------------------


def test_axes_cross_product_and_element_names():
    axes = sweep.parse_axes(
        ["optimizer.lr=1e-6,2e-6", "loss.kl_penalty=0,0.01", "slurm.extra_sbatch_args=[a, b],[c]"]
    )
    assert [a.values for a in axes] == [("1e-6", "2e-6"), ("0", "0.01"), ("[a, b]", "[c]")]
    found = sweep.elements(axes)
    assert len(found) == 8
    assert found[1].overrides == (
        "optimizer.lr=1e-6",
        "loss.kl_penalty=0",
        "slurm.extra_sbatch_args=[c]",
    )
    assert found[1].name == "1-lr=1e-6_kl_penalty=0_extra_sbatch_args=_c"
    assert sweep.split_values("'a,b',\"c,d\",e") == ["'a,b'", '"c,d"', "e"]
    assert sweep.array_spec(4, None) == "0-3" and sweep.array_spec(4, 2) == "0-3%2"
    # The same last key part twice: the whole keys name the elements.
    clash = sweep.elements(sweep.parse_axes(["optimizer.lr=1", "warm_start.lr=2"]))
    assert clash[0].name == "0-optimizer.lr=1_warm_start.lr=2"
    # Names are file names whatever the values hold: no slash, no shell syntax.
    hostile = sweep.elements(sweep.parse_axes(["slurm.env.X=$(touch /tmp/x),'; rm -rf ~'"]))
    assert [e.name for e in hostile] == ["0-X=_touch_tmp_x", "1-X=_rm_-rf"]


def test_every_value_in_the_array_script_is_quoted():
    """Like sbatch.sh.j2: `|q` places every value. The #SBATCH lines are the exception: they are
    copied from the elements' own rendered scripts, where each value was quoted already."""
    template = (REPO / "templates" / "sweep.sh.j2").read_text()
    expressions = [e.strip() for e in re.findall(r"{{(.*?)}}", template)]
    assert [e for e in expressions if not re.search(r"\|\s*q$", e)] == ["line"]
    assert "{% for line in sbatch_lines %}" in template


def test_task_states_of_pending_and_running_tasks():
    """squeue -r and sacct name array tasks ARRAY_INDEX; sacct keeps the tasks not started yet
    in one record (ARRAY_[2-5%2])."""
    text = "7_0|RUNNING\n7_1|CANCELLED by 0\n7_[2-4,6%2]|PENDING\n7|COMPLETED\n"
    assert sweep_jobs._parse_states(text, "|") == {
        0: "RUNNING",
        1: "CANCELLED",
        2: "PENDING",
        3: "PENDING",
        4: "PENDING",
        6: "PENDING",
    }


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["optimizer.lr"], "cannot read `--sweep optimizer.lr`"),
        (["optimizer.lr=1,,2"], "cannot read `--sweep optimizer.lr=1,,2`"),
        (["run.name=a,b"], "`run.name` is one value for the whole sweep"),
        (["optimizer.lr=1,2", "optimizer.lr=3"], "`--sweep optimizer.lr=...` is given twice"),
        (["optimizer.lr=1,1"], "repeats a value"),
    ],
)
def test_bad_axes_are_refused(flags, message):
    with pytest.raises(RlflowError) as raised:
        sweep.parse_axes(flags)
    assert message in raised.value.diagnostics[0].message


def test_dry_run_shows_the_matrix_and_one_script_and_submits_nothing(tmp_path):
    result = cli(
        "submit",
        str(TINY),
        "--sweep",
        "optimizer.lr=1e-6,2e-6",
        "--sweep",
        "loss.kl_penalty=0,0.01",
        "--max-concurrent",
        "2",
        "--nodes",
        "1",
        "--gpus",
        "4",
        "--dry-run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("#!/bin/bash") == 2  # the array's script and element 0's
    assert "#SBATCH --array=0-3%2\n" in out
    assert "# ---- element 0: 0-lr=1e-6_kl_penalty=0/script.sbatch (rendered) ----" in out
    matrix = out.split("matrix:\n")[1].splitlines()[:5]
    assert [line.split() for line in matrix] == [
        ["#", "element", "optimizer.lr", "loss.kl_penalty", "worst", "GPU-h"],
        ["0", "0-lr=1e-6_kl_penalty=0", "1e-6", "0", "2.7"],
        ["1", "1-lr=1e-6_kl_penalty=0.01", "1e-6", "0.01", "2.7"],
        ["2", "2-lr=2e-6_kl_penalty=0", "2e-6", "0", "2.7"],
        ["3", "3-lr=2e-6_kl_penalty=0.01", "2e-6", "0.01", "2.7"],
    ]
    # tiny-cpu.yaml: 10 minutes, 4 GPUs, max_requeues 1 + max_failure_retries 2.
    assert "GPU-hours:  2.7 for the sweep (4 x 0.67, one attempt each)" in out
    assert (
        "worst case: 10.7 for the sweep (each element 4 attempts: the first + "
        "slurm.max_requeues 1 + slurm.max_failure_retries 2); no cap (slurm.max_gpu_hours)"
    ) in out
    assert "dry run: nothing submitted" in out
    assert not (tmp_path / "runs").exists()


def test_a_sweep_dry_run_imports_no_torch(tmp_path):
    """Login-node promise, for sweeps too (the single-job case: test_launch_dry_run.py)."""
    code = (
        "import sys\nfrom rlflow.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    status = done.code\n"
        "heavy = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]\n"
        "print('heavy modules:', heavy, file=sys.stderr)\nsys.exit(status)\n"
    )
    args = [str(TINY), "--sweep", "optimizer.lr=1,2", "--nodes", "1", "--gpus", "1", "--dry-run"]
    result = subprocess.run(
        [PYTHON, "-c", code, "submit", *args], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "heavy modules: []" in result.stderr


def test_gpu_hours_worst_case_and_the_cap(tmp_path):
    args = [str(TINY), "slurm.max_requeues=3", "--nodes", "2", "--gpus", "4", "--time", "2:00:00"]
    dry = cli("submit", *args, "--dry-run", cwd=tmp_path)
    assert_printed(
        dry,
        "GPU-hours:  16.0 (2 nodes x 4 GPUs x 2.00 h) per attempt\n",
        "worst case: 96.0 GPU-hours (6 attempts: the first + slurm.max_requeues 3 + "
        "slurm.max_failure_retries 2); no cap (slurm.max_gpu_hours)\n",
    )
    capped = cli("submit", *args, "slurm.max_gpu_hours=50", "--dry-run", cwd=tmp_path)
    assert capped.returncode == 2
    assert (
        "error[submit.gpu-hours-cap]: this job may use 96 GPU-hours in the worst case, over the "
        "cap of 50 (slurm.max_gpu_hours); nothing was submitted"
    ) in capped.stderr
    assert "--> command line `slurm.max_gpu_hours=50`" in capped.stderr
    assert "= note: 16.0 GPU-hours per attempt, up to 6 attempts" in capped.stderr
    assert "raise slurm.max_gpu_hours to 96 if you mean it" in capped.stderr
    assert "# ---- summary ----" not in capped.stdout
    fits = cli("submit", *args, "slurm.max_gpu_hours=96", "--dry-run", cwd=tmp_path)
    assert fits.returncode == 0 and "cap 96 (slurm.max_gpu_hours)" in fits.stdout
    # A sweep's cap is on its total: 2 elements of 96 fit 200, 4 do not.
    sweep_args = [*args, "slurm.max_gpu_hours=200", "--sweep", "optimizer.lr=1,2", "--dry-run"]
    assert cli("submit", *sweep_args, cwd=tmp_path).returncode == 0
    over = cli("submit", *sweep_args, "--sweep", "loss.kl_penalty=0,1", cwd=tmp_path)
    assert over.returncode == 2
    assert (
        "this sweep of 4 elements may use 384 GPU-hours in the worst case, over the cap of 200"
    ) in over.stderr
    # Elements with other requeue limits have other worst cases: 16 x (1 + 0 + 2), 16 x (1 + 2 + 2).
    mixed = cli(
        "submit",
        *args[:1],
        *args[2:],
        "--sweep",
        "slurm.max_requeues=0,2",
        "--dry-run",
        cwd=tmp_path,
    )
    rows = [line.split() for line in mixed.stdout.split("matrix:\n")[1].splitlines()[1:3]]
    assert [row[-1] for row in rows] == ["48.0", "80.0"], mixed.stdout
    assert "worst case: 128.0 for the sweep (the elements' attempts differ: see the matrix)" in (
        mixed.stdout
    )
    zero = cli("submit", *args, "slurm.max_gpu_hours=0", "--dry-run", cwd=tmp_path)
    assert zero.returncode == 2 and "over the cap of 0 (slurm.max_gpu_hours)" in zero.stderr
    assert not (tmp_path / "runs").exists()


# --- on the local Slurm cluster -----------------------------------------------------------------


@pytest.mark.usefixtures("slurm_cluster")
def test_a_sweep_of_the_tiny_recipe_trains_every_element(tmp_path):
    """The real trainer on its tiny built-in model, 1 step per element, both at once. (The cross
    product of axes and --max-concurrent: the tests after this one, with cheap commands.)"""
    array, sweep_dir = submit_sweep(
        str(TINY_TRAIN),
        f"run.output_dir={tmp_path}",
        "grpo.max_num_steps=1",
        "grpo.num_prompts_per_step=4",  # small steps: the shared 2-core machine is busy
        "grpo.num_generations_per_prompt=4",
        "warm_start.num_steps=0",
        "grpo.val_at_start=false",
        "grpo.max_val_samples=8",
        "--sweep",
        "optimizer.lr=1e-4,2e-4",
        "--nodes",
        "1",
        "--gpus",
        "1",
        cwd=REPO,
    )
    tasks = wait_all(array, 2, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=840)
    names = [e["name"] for e in json.loads((sweep_dir / "sweep.json").read_text())["elements"]]
    logs = {n: (sweep_dir / n / "logs" / f"slurm-{array}_{i}.out") for i, n in enumerate(names)}
    assert set(tasks.values()) == {"COMPLETED"}, {n: p.read_text() for n, p in logs.items()}
    # Each element is its own run: its own recipe, metrics and checkpoints.
    for index, name in enumerate(names):
        run = sweep_dir / name
        recipe = (run / "recipe.yaml").read_text()
        lr = ("1e-4", "2e-4")[index]
        assert recipe.startswith(
            f"# sweep element {index} of 2 ({sweep_dir.name}): optimizer.lr={lr}\n"
        )
        assert f"lr: {float(lr)}\n" in recipe
        assert (run / "job_id").read_text() == f"{array}_{index}\n"
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()]
        assert steps[-1] == 1
        assert f"train {run}/recipe.yaml --run-dir {run}" in logs[name].read_text()
    status = cli("status", str(sweep_dir), cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0] == (
        f"sweep {sweep_dir.name}: job array {array}, 2 elements (optimizer.lr (2)): 2 COMPLETED"
    )
    assert lines[1].split() == ["element", "job", "state", "step", "reward", "val", "acc"]
    for index, (name, line) in enumerate(zip(names, lines[2:], strict=True)):
        assert re.fullmatch(
            rf"  {re.escape(name)} +{array}_{index} +COMPLETED +1/1 +\d\.\d{{3}} +\d\.\d{{3}} @1",
            line,
        ), line


@pytest.mark.usefixtures("slurm_cluster")
def test_max_concurrent_caps_the_elements_running_at_once(tmp_path):
    """A 2x2 sweep at most 2 at once: Slurm's array throttle, and sacct's start and end times."""
    array, sweep_dir = submit_sweep(
        str(TINY),
        "--sweep",
        "slurm.env.WHICH=a,b",
        "--sweep",
        "slurm.env.OTHER=c,d",
        "--max-concurrent",
        "2",
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--command",
        "true",
        cwd=tmp_path,
    )
    assert job_fields(f"{array}_0")["ArrayTaskThrottle"] == "2"
    tasks = wait_all(array, 4, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    assert set(tasks.values()) == {"COMPLETED"}, tasks
    times = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", array, "-o", "Start,End"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    spans = [tuple(datetime.fromisoformat(t) for t in line.split("|")) for line in times]
    assert len(spans) == 4
    assert max(sum(s <= start < e for s, e in spans) for start, _ in spans) <= 2
    status = cli("status", str(sweep_dir), cwd=tmp_path)
    assert status.stdout.splitlines()[0] == (
        f"sweep {sweep_dir.name}: job array {array}, 4 elements (slurm.env.WHICH (2) x "
        "slurm.env.OTHER (2)), at most 2 at once: 4 COMPLETED"
    ), status.stdout + status.stderr


@pytest.mark.usefixtures("slurm_cluster")
def test_cancel_one_element_then_the_whole_sweep(tmp_path):
    array, sweep_dir = submit_sweep(
        str(TINY),
        "--sweep",
        "slurm.env.WHICH=a,b",
        "--sweep",
        "slurm.env.OTHER=c,d",
        "--max-concurrent",
        "3",
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--command",
        "sleep 900",
        cwd=tmp_path,
    )
    # --max-concurrent 3: three run, the fourth waits for a slot.
    running = wait_all(array, 4, {"RUNNING", "PENDING"}, timeout=60)
    deadline = time.monotonic() + 60
    while sorted(running.values()) != ["PENDING", "RUNNING", "RUNNING", "RUNNING"]:
        assert time.monotonic() < deadline, running
        time.sleep(1)
        running = wait_all(array, 4, {"RUNNING", "PENDING"}, timeout=60)
    one = cli("cancel", f"{array}_1", cwd=tmp_path)
    assert one.returncode == 0 and one.stdout.startswith(f"cancelled job {array}_1 (was ")
    by_dir = cli("cancel", str(next(sweep_dir.glob("2-*"))), cwd=tmp_path)
    assert by_dir.returncode == 0 and by_dir.stdout.startswith(f"cancelled job {array}_2 (was ")
    wait_all(array, 4, {"RUNNING", "PENDING", "CANCELLED"}, timeout=60)
    whole = cli("cancel", str(sweep_dir), cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert re.fullmatch(
        rf"cancelled sweep {sweep_dir.name} \(job array {array}\): .*; 2 had already ended\n",
        whole.stdout,
    )
    assert wait_all(array, 4, {"CANCELLED"}, timeout=120) == {
        f"{array}_{i}": "CANCELLED" for i in range(4)
    }
    status = cli("status", str(sweep_dir), cwd=tmp_path).stdout
    assert status.splitlines()[0].endswith(": 4 CANCELLED")
    again = cli("cancel", str(sweep_dir), cwd=tmp_path)
    assert again.stdout.strip().endswith("has ended: nothing to cancel")
    # An element's job id finds its run directory (through the manifest); the sweep directory
    # itself has no logs of its own.
    element = cli("status", f"{array}_0", cwd=tmp_path)
    assert f"run dir: {next(sweep_dir.glob('0-*'))}\n" in element.stdout, element.stderr
    logs = cli("logs", str(sweep_dir), cwd=tmp_path)
    assert logs.returncode == 2 and f"error[jobs.sweep-dir]: {sweep_dir} is a sweep" in logs.stderr


@pytest.mark.usefixtures("slurm_cluster")
def test_requeue_and_resume_per_element(tmp_path):
    """Both elements get the time-limit warning, save, are requeued (as their own array task)
    and resume in their own run directory."""
    out = tmp_path / "records"
    (out / "first").mkdir(parents=True)
    (out / "second").mkdir()
    array, sweep_dir = submit_sweep(
        str(TINY),
        "--sweep",
        "slurm.env.ELEMENT=first,second",
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--command",
        # Each element records into its own folder (the payload names files by rank only).
        f"bash -c 'exec {payload_command('requeue.py', str(out))}/$ELEMENT'",
        cwd=tmp_path,
    )
    names = sorted(p.name for p in sweep_dir.iterdir() if p.name[0].isdigit())
    # The warning as Slurm's --signal=B:USR1 sends it (to each task's batch shell), once the
    # element's rank listens: tests/launch/test_launch_slurm.py waits for Slurm's own timer.
    for index, element in enumerate(("first", "second")):
        task = f"{array}_{index}"
        wait_for_files([out / element / "rank-0.ready"], task, sweep_dir / names[index])
        subprocess.run(["scancel", "--batch", "--signal=USR1", task], check=True)
    deadline = time.monotonic() + 200
    requeued: set[str] = set()
    while len(requeued) < 2 and time.monotonic() < deadline:
        for index in range(2):
            task = f"{array}_{index}"
            fields = job_fields(task)
            if (
                task not in requeued
                and fields["Restarts"] == "1"
                and fields["JobState"] == "PENDING"
            ):
                time.sleep(3)  # Slurm holds a requeued job back; not in the requeue's second
                subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], check=True)
                requeued.add(task)
        time.sleep(0.5)
    assert len(requeued) == 2, [
        batch_log(sweep_dir / n, f"{array}_{i}") for i, n in enumerate(names)
    ]
    wait_all(array, 2, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=150)
    for index, name in enumerate(names):
        run = sweep_dir / name
        log = batch_log(run, f"{array}_{index}")
        assert job_fields(f"{array}_{index}")["JobState"] == "COMPLETED", log
        assert "requeueing: attempt 1 continues the run" in log
        assert sorted(p.name for p in (run / "status").iterdir()) == ["attempt-0", "attempt-1"]
        outcomes = [json.loads(line)["outcome"] for line in (run / "attempts.jsonl").open()]
        assert outcomes == ["time-limit", "completed"]
        assert (out / ("first", "second")[index] / "rank-0.txt").read_text() == (
            "attempt 0: warned, saved\nattempt 1: resumed after 'attempt 0: warned, saved'\n"
        )


HOSTILE_VALUES = ["$(touch {canary})", "'; touch {canary}; '", "`touch {canary}`"]


@pytest.mark.usefixtures("slurm_cluster")
def test_hostile_sweep_values_are_data(tmp_path):
    """Values that would run in a shell reach the job as the exact text typed, and a hostile
    key is refused before anything is submitted."""
    canary = tmp_path / "canary"
    values = [v.format(canary=canary) for v in HOSTILE_VALUES]
    command = f"{PYTHON} -c \"import os; print('VALUE=' + os.environ['HOSTILE'])\""
    array, sweep_dir = submit_sweep(
        str(TINY),
        "--sweep",
        "slurm.env.HOSTILE=" + ",".join(values),
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--command",
        command,
        cwd=tmp_path,
    )
    assert wait_all(array, 3, {"COMPLETED", "FAILED", "CANCELLED"}, 180) == {
        f"{array}_{i}": "COMPLETED" for i in range(3)
    }
    assert not canary.exists()
    printed = []
    for name in sorted(p.name for p in sweep_dir.iterdir() if p.name[0].isdigit()):
        assert "/" not in name and "$" not in name and "'" not in name and "`" not in name
        rank0 = (sweep_dir / name / "logs" / "rank-0.log").read_text()
        printed += [line[6:] for line in rank0.splitlines() if line.startswith("VALUE=")]
    # A quoted value is YAML: its quotes are syntax (like in a recipe), the rest is text.
    assert printed == [values[0], f"; touch {canary}; ", values[2]]
    refused = cli(
        "submit",
        str(TINY),
        "--sweep",
        f"$(touch {canary})=1,2",
        "--nodes",
        "1",
        "--gpus",
        "1",
        cwd=tmp_path,
    )
    assert refused.returncode == 2 and "error[recipe.unknown-key]" in refused.stderr
    assert not canary.exists()


@pytest.mark.usefixtures("slurm_cluster")
def test_one_bad_element_stops_the_whole_sweep(tmp_path):
    """Element 3 asks for tensor parallel 2 on 1 rank: the whole check refuses it, and nothing
    reaches Slurm, not even the good elements."""
    before = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True
    ).stdout
    result = cli(
        "submit",
        str(TINY),
        "--sweep",
        "loss.kl_penalty=0,0.01",
        "--sweep",
        "parallelism.tensor_parallel_size=1,2",
        "--nodes",
        "1",
        "--gpus",
        "1",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stdout
    assert "--> command line `parallelism.tensor_parallel_size=2`" in result.stderr
    assert (
        "error[sweep.element]: sweep element 1 (loss.kl_penalty=0, "
        "parallelism.tensor_parallel_size=2) is not valid (above); nothing was submitted"
    ) in result.stderr
    assert "sweep element 3 (loss.kl_penalty=0.01, parallelism.tensor_parallel_size=2)" in (
        result.stderr
    )
    assert "sweep element 0" not in result.stderr and "submitted" not in result.stdout
    assert not (tmp_path / "runs").exists()
    after = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=True
    ).stdout
    assert after == before
    # Options a job array cannot vary per element are refused the same way.
    differs = cli(
        "submit",
        str(TINY),
        "--sweep",
        "slurm.time_limit=5,6",
        "--nodes",
        "1",
        "--gpus",
        "1",
        cwd=tmp_path,
    )
    assert differs.returncode == 2
    assert "error[sweep.sbatch-differs]: sweep element 1 (slurm.time_limit=6) needs " in (
        differs.stderr
    )
    assert not (tmp_path / "runs").exists()
