"""W&B beside TensorBoard (`logging.wandb`), for real in offline mode: a short `rlflow train` of
the tiny CPU recipe writes an offline W&B run (WANDB_DIR in tmp, no network), whose records hold
the resolved recipe as config and the metrics.jsonl values as history; a resumed run continues
the same W&B run id. The dry run reports a missing package without importing wandb."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_runs import ROOT, train

from rlflow.train.metrics import read_metrics
from rlflow.train.wandb_log import state as wandb_state

TINY_CPU = ROOT / "tests" / "launch" / "recipes" / "tiny-cpu.yaml"
WANDB = [
    "logging.wandb.enabled=true",
    "logging.wandb.mode=offline",
    "logging.wandb.project=rlflow-tests",
    "logging.wandb.group=offline-group",
    "logging.wandb.tags=[tiny, cpu]",
    "warm_start.num_steps=0",
    "grpo.val_at_start=false",
    "grpo.val_period=0",
]


def wandb_records(path: Path):
    """The protobuf records of an offline run's .wandb file: W&B's LevelDB-style log (a 7-byte
    header, then 32 KiB blocks of [crc32, length, type] chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_run(wandb_dir: Path, run_id: str, which: int) -> tuple[dict, dict, dict[int, dict]]:
    """(run record, config, history by step) of the which-th offline run of `run_id`."""
    runs = sorted((wandb_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    files = list(runs[which].glob(f"run-{run_id}.wandb"))
    assert len(files) == 1, list(runs[which].iterdir())
    run, config, history = None, {}, {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history[int(row["_step"])] = row
    assert run is not None
    return run, config, history


def test_offline_run_has_the_recipe_and_metrics_and_resumes_the_same_run(tmp_path):
    run_dir, wandb_dir = tmp_path / "run", tmp_path / "wandb-files"
    env = {"WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    first = train(run_dir, *WANDB, "grpo.max_num_steps=2", env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = wandb_state(run_dir)[0]
    assert run_id.isalnum()
    run, config, history = offline_run(wandb_dir, run_id, 0)
    assert (run.run_id, run.project, run.run_group) == (run_id, "rlflow-tests", "offline-group")
    assert list(run.tags) == ["tiny", "cpu"] and run.display_name == "run"
    # The resolved recipe is the config: overrides applied, every section present.
    assert config["grpo"]["max_num_steps"] == 2
    assert config["logging"]["wandb"]["mode"] == "offline"
    assert config["model"]["checkpoint"] == "builtin:tiny-qwen25vl"
    # The same numbers as metrics.jsonl, step for step.
    metrics = {r["step"]: r for r in read_metrics(run_dir)}
    assert sorted(history) == sorted(metrics) == [1, 2]
    for step, record in metrics.items():
        for key in ("train/reward", "train/loss", "time/step", "speed/step_tokens_per_s"):
            assert history[step][key] == pytest.approx(record[key], rel=1e-6), (step, key)

    # A requeue runs the trainer again on the same run directory: it resumes from the step-2
    # checkpoint and continues the same W&B run.
    second = train(run_dir, *WANDB, "grpo.max_num_steps=3", env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert wandb_state(run_dir)[0] == run_id
    run, config, history = offline_run(wandb_dir, run_id, 1)
    assert run.run_id == run_id and config["grpo"]["max_num_steps"] == 3
    assert 3 in history
    assert history[3]["train/reward"] == pytest.approx(read_metrics(run_dir)[-1]["train/reward"])
    assert len(list((wandb_dir / "wandb").glob("offline-run-*"))) == 2
    assert not list((wandb_dir / "wandb").glob("run-*"))  # offline: nothing that synced online


PROBE = (
    "import sys\nfrom rlflow.cli import main\n"
    "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    status = done.code\n"
    "print('wandb imported:', 'wandb' in sys.modules, file=sys.stderr)\nsys.exit(status)\n"
)


def test_dry_run_with_wandb_enabled_asks_importlib_only(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", PROBE, "submit", str(TINY_CPU), *WANDB[:3],
         "--nodes", "1", "--gpus", "1", "--dry-run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wandb imported: False" in result.stderr


def test_dry_run_without_the_wandb_package_says_how_to_install_it(tmp_path):
    """wandb is installed in the dev environment (its tests need it), so its absence is made
    for this one process: a sitecustomize on PYTHONPATH sets sys.modules["wandb"] = None, which
    makes both importlib.util.find_spec and `import wandb` report it missing, as an environment
    without the package would. The real console script runs the dry run."""
    shim = tmp_path / "no-wandb"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text('import sys\nsys.modules["wandb"] = None\n')
    result = subprocess.run(
        [str(Path(sys.executable).parent / "rlflow"), "submit", str(TINY_CPU), *WANDB[:2],
         "--nodes", "1", "--gpus", "1", "--dry-run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(shim)},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error[recipe.wandb-missing]: `logging.wandb.enabled` is true, but the wandb package is "
        "not installed\n"
        "  --> command line `logging.wandb.enabled=true`\n"
    )
    assert (
        "help: install it where the job runs: `uv sync --extra wandb` (or `pip install "
        "'rlflow[wandb]'`); or set logging.wandb.enabled: false"
    ) in result.stderr
    assert "Traceback" not in result.stderr and "---- script.sbatch" not in result.stdout
    assert not list(tmp_path.glob("runs*"))


def test_train_refuses_to_start_without_the_package(tmp_path):
    shim = tmp_path / "no-wandb"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text('import sys\nsys.modules["wandb"] = None\n')
    result = train(tmp_path / "run", *WANDB, env={"PYTHONPATH": f"{shim}:{ROOT}"}, timeout=300)
    assert result.returncode == 2
    assert "error[recipe.wandb-missing]" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        ("fifo", "it is a named pipe (FIFO), not a regular file"),
        ("zero", "it links to /dev/zero, which is a character device, not a regular file"),
    ],
)
def test_a_run_id_file_that_is_not_a_file_is_named_and_replaced(tmp_path, kind, what):
    """Issue 36, item 4: a named pipe at RUN_DIR/wandb_run_id made a resumed run wait forever,
    a link to /dev/zero filled its memory. Now a warning names it and the run gets a new W&B
    run. In a child with a timeout and an address-space limit, so a regression fails the test."""
    import resource

    path = tmp_path / "wandb_run_id"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    probe = (
        "import sys\nfrom pathlib import Path\nfrom rlflow.train import wandb_log\n"
        "print(wandb_log.state(Path(sys.argv[1])))\nprint(wandb_log.run_id(Path(sys.argv[1])))\n"
    )
    memory = 2 << 30
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory)),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "(None, None)"
    assert f"warning[wandb.run-id]: {path}: {what}" in done.stderr
    new_id = done.stdout.splitlines()[1]
    assert path.is_file() and not path.is_symlink()
    assert wandb_state(tmp_path) == (new_id, -1)
