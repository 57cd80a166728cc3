"""Hostile `--sweep` values (issue 23, items 7 and 8): a value repeated as written or once typed
(`1e-4,0.0001`), and a sweep too large to check and submit. Each is refused by the console
script's dry run before any element is prepared: exit 2, the flag and the fix, nothing written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlflow.launch import sweep
from tests.slurm.jobs import PYTHON, RECIPES

RLFLOW = Path(PYTHON).parent / "rlflow"
TINY = RECIPES / "tiny-cpu.yaml"


def refused(tmp_path: Path, *sweeps: str) -> str:
    flags = [arg for value in sweeps for arg in ("--sweep", value)]
    result = subprocess.run(
        [str(RLFLOW), "submit", str(TINY), *flags, "--nodes", "1", "--gpus", "1", "--dry-run"]
        + ["--skip-pin-check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and not list(tmp_path.iterdir())
    return result.stderr


@pytest.mark.parametrize(
    "values, first, second",
    [
        ("1e-4, 1e-4", "1e-4", "1e-4"),  # the same text after the space
        ("1e-4,0.0001", "1e-4", "0.0001"),  # the same number
        ("2e-6,1e-6,2.0e-6", "2e-6", "2.0e-6"),
    ],
)
def test_a_value_repeated_once_typed_is_refused(tmp_path, values, first, second):
    stderr = refused(tmp_path, f"optimizer.lr={values}")
    assert (
        f"error[sweep.axis]: `--sweep optimizer.lr={values}` repeats a value: {first} and "
        f"{second} are the same `optimizer.lr` (two elements would be the same run)"
    ) in stderr


def test_values_that_differ_once_typed_are_kept():
    (axis,) = sweep.parse_axes(["data.prompt_suffix=' a',a"])
    assert axis.values == ("' a'", "a")
    assert len(sweep.elements(sweep.parse_axes(["loss.kl_penalty=0,0.5,1"]))) == 3


def test_a_sweep_over_the_element_cap_is_refused_at_once(tmp_path):
    many = ",".join(f"{i + 1}e-7" for i in range(8000))
    stderr = refused(tmp_path, f"optimizer.lr={many}")
    assert (
        "error[sweep.axis]: `--sweep optimizer.lr=...` lists 8000 values: rlflow submits at "
        f"most {sweep.MAX_ELEMENTS} elements as one job array"
    ) in stderr
    assert "help: split it into several sweeps" in stderr
    lrs = ",".join(f"{i + 1}e-7" for i in range(101))
    product = refused(tmp_path, f"optimizer.lr={lrs}", "generation.top_k=0,1,2,3,4,5,6,7,8,9")
    assert "the sweep is 1010 elements: rlflow submits at most 1000" in product
