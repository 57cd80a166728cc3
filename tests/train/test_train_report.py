"""`rlflow report` on what is not a run's metrics (issue 36, item 6): a directory where
metrics.jsonl belongs, a value that is not a number, numbers beyond any float, a folder it cannot
write, a file with no number to plot (it wrote empty plots, exit 0). Each is exit 2 naming the
file (and step and key) and what to do, never a traceback, and no plot written. Through the
console script, as users run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RLFLOW = Path(sys.executable).parent / "rlflow"
PLOTS = ["accuracy.png", "kl.png", "reward.png", "step_time.png"]


def report(run: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(RLFLOW), "report", str(run), *args], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        (None, "error[report.unreadable]: cannot read {path}: it is a directory"),
        ("", "error[report.no-metrics]: {path} holds no step with a number to plot (0 records)"),
        (
            '{"step": 1, "train/loss": 0.5}\n',
            "error[report.no-metrics]: {path} holds no step with a number to plot (1 record)",
        ),
        (
            '{"step": 1, "train/reward": 0.5}\n{"step": 2, "train/reward": "0.7"}\n',
            "error[report.not-a-number]: {path}: step 2: `train/reward` is '0.7', not a number",
        ),
        (
            '{"step": 1, "train/kl": [1]}\n',
            "error[report.not-a-number]: {path}: step 1: `train/kl` is [1], not a number",
        ),
    ],
    ids=["directory", "empty", "no-plotted-key", "string", "list"],
)
def test_a_file_with_no_metric_to_plot_is_refused(tmp_path, metrics, message):
    path = tmp_path / "metrics.jsonl"
    if metrics is None:
        path.mkdir()
    else:
        path.write_text(metrics)
    done = report(tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message.format(path=path) in done.stderr
    assert not (tmp_path / "plots").exists()


def test_huge_and_non_finite_values_are_gaps_and_the_rest_is_plotted(tmp_path):
    """An integer beyond any float, 1e308 and Infinity (a diverged step) cannot be drawn: gaps,
    next to the steps that can."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "train/reward": 0.25, "train/kl": 1' + "0" * 400 + "}\n"
        '{"step": 2, "train/reward": 1e308, "train/kl": Infinity}\n'
        '{"step": 3, "train/reward": 0.5, "train/kl": 0.01}\n'
    )
    done = report(tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == PLOTS


def test_an_out_folder_that_cannot_be_made_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/reward": 0.5}\n')
    (tmp_path / "a-file").write_text("")
    done = report(tmp_path, "--out", str(tmp_path / "a-file" / "plots"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error[report.out]: cannot write the plots to {tmp_path}/a-file/plots: Not a " in (
        done.stderr
    )
    assert "help: pass --out a folder you can write to" in done.stderr
