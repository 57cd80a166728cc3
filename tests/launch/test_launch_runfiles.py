"""Damaged run and sweep directories (rlflow/launch/runfiles.py, sweep.read_manifest): every file
that `status`, `status --watch`, `logs` and `cancel` read is replaced by random bytes, a
directory, JSON of another type, or its JSON record with a key missing or mistyped; what they
do then is a diagnostic naming the file (exit 2), never a traceback, and nothing is cancelled on
a record that was not read whole. The property tests call the commands' own functions (one
process, hundreds of cases); the CLI cases below run the console's entry point as users do."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.errors import RlflowError, print_diagnostics
from rlflow.launch import jobs, local, monitor, sweep_jobs

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=6,
)
CASES = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def local_run(run: Path) -> dict[str, object]:
    """A local run directory as rlflow writes it (its launcher long gone); its JSON records."""
    records = {
        "launcher.json": {
            "format": 1,
            "pid": 2**22 + 7,
            "start_ticks": 1,
            "boot_id": "",
            "host": "elsewhere",
            "attempt": 0,
            "nproc": 2,
            "command": ["rlflow", "train", "tiny.yaml", "--run-dir", str(run), "--nproc", "2"],
            "cwd": "/",
            "started": 1.0e9,
        },
        "attempts.jsonl": {
            "attempt": 0,
            "job_id": "",
            "outcome": "stopped",
            "reason": "saved and stopped on SIGHUP",
            "nodes": "here",
            "excluded": [],
            "step": 3,
            "checkpoint_step": 3,
            "exit_code": 75,
            "action": "resume: the same command continues from the newest checkpoint",
            "ended": "2026-12-01T12:00:00",
        },
        "metrics.jsonl": {"step": 3, "time/step": 2.0, "train/reward": 0.5, "val/accuracy": 0.25},
        "status/attempt-0/heartbeat/rank-0.json": {"phase": "rollout", "step": 4, "wall": 1e9},
    }
    for name, record in records.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(json.dumps(record) + "\n")
    (run / "recipe.resolved.yaml").write_text("grpo:\n  max_num_steps: 5\n")
    (run / "status/attempt-0/first-failure").write_text("1\nrank 0 failed\nhere\n")
    (run / "logs").mkdir()
    (run / "logs/rank-0.log").write_text("step 3\n")
    (run / "checkpoints/step_3").mkdir(parents=True)
    return records


FILES = [
    "launcher.json",
    "attempts.jsonl",
    "metrics.jsonl",
    "recipe.resolved.yaml",
    "status/attempt-0/heartbeat/rank-0.json",
    "status/attempt-0/first-failure",
    "status",
    "logs/rank-0.log",
]


def damage(run: Path, records: dict, name: str, how: str, data: bytes, key: int, value):
    """Replace RUN_DIR/name: by bytes, a directory, another JSON value, or its record with `key`
    (its key number `key`, modulo their count) dropped (value None) or set to `value`."""
    path = run / name
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    if how == "directory":
        path.mkdir()
        return
    if how == "bytes" or name not in records:
        path.write_bytes(data)
        return
    if how == "json":
        path.write_text(json.dumps(value) + "\n")
        return
    record = dict(records[name])
    key = sorted(record)[key % len(record)]
    if how == "missing":
        del record[key]
    else:
        record[key] = value
    path.write_text(json.dumps(record) + "\n")


def every_command(run: Path) -> list[str]:
    """What status, --watch's screen, logs and cancel make of the directory: their text, or
    their diagnostics rendered; anything else (a traceback) fails the test."""
    shown = []
    for act in (
        lambda: local.describe(run),
        lambda: monitor.body(local.screen_head(run)[1], time.time()),
        lambda: jobs.log_path(jobs.resolve(str(run)), 0, False),
        lambda: local.cancel(run),
    ):
        try:
            result = act()
        except RlflowError as err:
            print_diagnostics(err.diagnostics, stream=sys.stderr)
            shown.append(err.diagnostics)
            continue
        shown.append(result)
    return shown


@CASES
@given(
    name=st.sampled_from(FILES),
    how=st.sampled_from(["bytes", "directory", "json", "missing", "mistyped"]),
    data=st.binary(max_size=200),
    key=st.integers(0, 99),
    value=JSON,
)
def test_a_damaged_local_run_directory_is_named_never_a_traceback(
    tmp_path_factory, name, how, data, key, value
):
    run = tmp_path_factory.mktemp("run")
    records = local_run(run)
    damage(run, records, name, how, data, key, value)
    text, problems = local.describe(run)
    assert text.startswith(f"local run {run.name}: ")
    for problem in problems:
        assert problem.file and problem.file.startswith(str(run)), problem
        assert problem.code == "jobs.damaged-file" and problem.help
    every_command(run)


@CASES
@given(
    name=st.sampled_from(FILES),
    how=st.sampled_from(["bytes", "directory", "json", "missing", "mistyped"]),
    data=st.binary(max_size=200),
    key=st.integers(0, 99),
    value=JSON,
)
def test_a_damaged_sweep_directory_is_named_never_a_traceback(
    tmp_path_factory, name, how, data, key, value
):
    """sweep.json (or one element's files) damaged: status and cancel read the manifest whole
    before anything reaches Slurm (an array job id that is not the file's is never cancelled)."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    manifest = {
        "format": 1,
        "array_job_id": "4411",
        "max_concurrent": None,
        "axes": [{"key": "grpo.lr", "values": ["1e-4", "1e-5"]}],
        "elements": [
            {"index": i, "name": f"lr{i}", "overrides": [f"grpo.lr={v}"], "job_id": f"4411_{i}"}
            for i, v in enumerate(["1e-4", "1e-5"])
        ],
    }
    (sweep_dir / "sweep.json").write_text(json.dumps(manifest))
    (sweep_dir / "job_id").write_text("4411\n")
    for element in manifest["elements"]:
        (sweep_dir / element["name"]).mkdir()
    records = local_run(sweep_dir / "lr1")
    target = "sweep.json" if name in ("launcher.json", "status") else f"lr1/{name}"
    element = {f"lr1/{name}": record for name, record in records.items()}
    damage(sweep_dir, {"sweep.json": manifest, **element}, target, how, data, key, value)
    try:
        found = sweep_jobs.manifest(sweep_dir)
    except RlflowError as err:
        assert target == "sweep.json"
        assert err.diagnostics[0].code == "sweep.manifest"
        assert err.diagnostics[0].file == str(sweep_dir / "sweep.json")
        return
    assert found["array_job_id"] == "4411" and len(found["elements"]) == 2
    text, problems = sweep_jobs.describe(sweep_dir, {0: "RUNNING", 1: "COMPLETED"}, found)
    assert text.startswith(f"sweep {sweep_dir.name}: job array 4411, 2 elements")
    assert all(p.file.startswith(str(sweep_dir / "lr1")) for p in problems)


# --- through the CLI --------------------------------------------------------------------------


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "rlflow.cli", *args], cwd=cwd, capture_output=True, text=True
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_a_job_id_file_with_more_than_one_job_id_is_refused(tmp_path, command):
    """`4411` + 300 spaces + `9999` once cancelled job 4411: a job id file holds one id."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "job_id").write_text("4411" + " " * 300 + "9999")
    result = cli(command, str(run), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error[jobs.job-id-file]: {run}/job_id holds '4411   ")
    assert "not a Slurm job id" in result.stderr


@pytest.mark.parametrize("args", [["status"], ["status", "--watch"], ["cancel"]])
def test_a_sweep_manifest_with_a_missing_key_is_refused_before_slurm(tmp_path, args):
    (tmp_path / "sweep.json").write_text(json.dumps({"format": 1, "array_job_id": "4411"}))
    result = cli(*args, str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"error[sweep.manifest]: {tmp_path}/sweep.json is not a sweep manifest rlflow can read: "
        "key `max_concurrent` is missing"
    )


def test_status_shows_what_it_read_then_names_the_damaged_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    local_run(run)
    failure = run / "status/attempt-0/first-failure"
    failure.unlink()
    failure.mkdir()
    with open(run / "attempts.jsonl", "a") as out:
        out.write('{"attempt": "one"}\n')
    result = cli("status", str(run), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout.startswith("local run run: STOPPED, attempt 0 saved and stopped on SIGHUP")
    assert f"error[jobs.damaged-file]: {run}/attempts.jsonl line 2: key `attempt` is 'one', " in (
        result.stderr
    )
    assert f"error[jobs.damaged-file]: {failure}: is a directory, where rlflow keeps a file" in (
        result.stderr
    )


def test_metric_names_and_strings_are_printed_escaped_never_sent():
    """A metrics line is data: an escape sequence in a key or a string value reaches the
    terminal as text; printable ones pass unchanged."""
    from rlflow.launch.runfiles import _clean

    record = {"step": 1, "train/\x1b[2Jreward": 0.5, "note": "ok\x07", "tags": ["a", "\x1b]0;x"]}
    assert _clean(record) == {
        "step": 1,
        "train/\\x1b[2Jreward": 0.5,
        "note": "ok\\x07",
        "tags": ["a", "\\x1b]0;x"],
    }
    plain = {"step": 2, "time/step": 1.5, "train/reward": 0.25, "run": "name-1"}
    assert _clean(plain) == plain
