"""`rlflow submit --dry-run`: golden output and the login-node promises (no torch, no Slurm
controller).

Refresh the golden files after an intended change with:
    RLFLOW_UPDATE_GOLDEN=1 uv run pytest tests/launch -k golden
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from rlflow.recipe.load import load_recipe
from tests.slurm.jobs import PYTHON, RECIPES, REPO, rlflow

GOLDEN = Path(__file__).resolve().parent / "golden"
TEMPLATE = REPO / "templates" / "sbatch.sh.j2"

GOLDEN_CASES = {
    "tiny-8n4g": [str(RECIPES / "tiny-cpu.yaml"), "--nodes", "8", "--gpus", "4"],
    "qwen25vl-3b-4n8g": [
        str(REPO / "recipes" / "vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml"),
        "slurm.partition=batch",
        "slurm.account=vlm",
        "--nodes",
        "4",
        "--gpus",
        "8",
    ],
    "apptainer-2n4g": [str(RECIPES / "apptainer.yaml"), "--nodes", "2", "--gpus", "4"],
    "full-features": [
        str(RECIPES / "full-features.yaml"),
        "--nodes",
        "2",
        "--gpus",
        "8",
        "--after",
        "41",
        "--after",
        "42",
        "--dependency-type",
        "afterany",
        "--time",
        "2-00:00:00",
    ],
}


def normalize(text: str, cwd: Path) -> str:
    """Replace what differs between machines and runs: paths, the run's time stamp and token."""
    text = text.replace(str(cwd), "<CWD>").replace(PYTHON, "<PYTHON>").replace(str(REPO), "<REPO>")
    return re.sub(r"-\d{8}-\d{6}-[0-9a-f]{6}", "-<STAMP>", text)


RECIPE_MARK = "# ---- recipe.yaml (resolved) ----\n"
SUMMARY_MARK = "# ---- summary ----\n"


# The golden output is that of a machine with no Slurm config: with one (the test cluster exports
# SLURM_CONF once any test in the session has started it), the dry run also checks the job's
# shape against `sinfo`, and these files would depend on the test order.
NO_CLUSTER = {**os.environ, "SLURM_CONF": "/nonexistent"}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_dry_run_golden(case, tmp_path):
    """The script and the summary are golden. The resolved recipe is compared with the loader's
    own result instead, so that a new key in base.yaml does not churn these files."""
    args = GOLDEN_CASES[case]
    result = rlflow("submit", *args, "--dry-run", cwd=tmp_path, env=NO_CLUSTER)
    assert result.returncode == 0, result.stderr
    script, rest = result.stdout.split(RECIPE_MARK)
    recipe_text, summary = rest.split(SUMMARY_MARK)
    got = normalize(
        script + RECIPE_MARK + "(compared with the loader's result)\n" + SUMMARY_MARK + summary,
        tmp_path,
    )
    golden = GOLDEN / f"{case}.txt"
    if os.environ.get("RLFLOW_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(got)
    assert got == golden.read_text(), (
        f"dry-run output of {case} changed; if intended: RLFLOW_UPDATE_GOLDEN=1 uv run pytest "
        f"tests/launch -k golden"
    )
    assert yaml.safe_load(recipe_text) == _expected_recipe(args)
    # tmp_path is no git repository: the pin check says it did not run.
    assert "warning[RF100]: pin check not run" in result.stderr
    assert "dry run: nothing submitted, no Slurm controller contacted" in result.stdout


def _expected_recipe(args: list[str]) -> dict:
    """What recipe.yaml must hold: the recipe and overrides as loaded, cluster from the flags."""
    overrides = [a for a in args[1:] if "=" in a and not a.startswith("-")]
    flag = dict(zip(args[1::1], args[2::1], strict=False))
    data = load_recipe(args[0], overrides).data
    data["cluster"] = {"num_nodes": int(flag["--nodes"]), "gpus_per_node": int(flag["--gpus"])}
    if "--time" in flag:
        data["slurm"]["time_limit"] = flag["--time"]
    return data


def test_dry_run_warns_about_a_missing_checkpoint(tmp_path):
    result = rlflow("submit", *GOLDEN_CASES["qwen25vl-3b-4n8g"], "--dry-run", cwd=tmp_path)
    assert (
        "warning[submit.path-missing]: `model.checkpoint` is '/path/to/Qwen2.5-VL-3B-Instruct', "
        "which does not exist here"
    ) in result.stderr
    assert "GPU-hours:  128.0 (4 nodes x 8 GPUs x 4.00 h)" in result.stdout


SLURM_CLIENTS = ("sbatch", "srun", "salloc", "scontrol", "squeue", "sacct", "scancel", "sinfo")


def test_dry_run_imports_no_torch_and_contacts_no_controller(tmp_path):
    """Login-node promise: each Slurm client on PATH is a tripwire that records being called."""
    traps = tmp_path / "bin"
    traps.mkdir()
    for name in SLURM_CLIENTS:
        (traps / name).write_text(f"#!/bin/sh\necho {name} >> {tmp_path}/called\nexit 1\n")
        (traps / name).chmod(0o755)
    code = (
        "import sys\nfrom rlflow.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    status = done.code\n"
        "heavy = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]\n"
        "print('heavy modules:', heavy, file=sys.stderr)\nsys.exit(status)\n"
    )
    env = {**os.environ, "PATH": f"{traps}:{os.environ['PATH']}", "SLURM_CONF": "/nonexistent"}
    workdir = tmp_path / "work"
    workdir.mkdir()
    result = subprocess.run(
        [PYTHON, "-c", code, "submit", *GOLDEN_CASES["tiny-8n4g"], "--dry-run"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "heavy modules: []" in result.stderr
    assert not (tmp_path / "called").exists()
    assert list(workdir.iterdir()) == []  # no run directory either


def test_every_template_value_is_quoted():
    """The template's only way to place a value is `|q` (shlex.quote) or a quoted word list."""
    expressions = re.findall(r"{{(.*?)}}", TEMPLATE.read_text())
    assert expressions
    unquoted = [e for e in expressions if not re.search(r"\|\s*q\s*$", e.strip())]
    assert unquoted == []
