"""`rlflow submit --dry-run`: golden output and the login-node promises (no torch, no Slurm
controller).

Refresh the golden files after an intended change with:
    RLFLOW_UPDATE_GOLDEN=1 uv run pytest tests/launch -k golden
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
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


def test_the_compiled_template_cache_changes_nothing(tmp_path):
    """The sbatch template's compiled code is cached the way Python caches a module's
    (rlflow/launch/render.py): never written with PYTHONDONTWRITEBYTECODE set, written without
    it, and a damaged cache file is compiled again. The script is the same every time."""
    cache = tmp_path / "cache"
    env = {k: v for k, v in NO_CLUSTER.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["XDG_CACHE_HOME"] = str(cache)

    def script(**more: str) -> str:
        result = rlflow(
            "submit", *GOLDEN_CASES["tiny-8n4g"], "--dry-run", cwd=tmp_path, env={**env, **more}
        )
        assert result.returncode == 0, result.stderr
        return normalize(result.stdout.split(RECIPE_MARK)[0], tmp_path)

    golden = script(PYTHONDONTWRITEBYTECODE="1")
    assert not cache.exists()
    assert script() == golden  # compiles, writes the cache
    (written,) = (cache / "rlflow" / "templates").iterdir()
    assert script() == golden  # from the cache
    for damage in (b"j2 not a cache", written.read_bytes()[:40], b""):
        written.write_bytes(damage)
        assert script() == golden
    assert written.stat().st_size > 1000  # compiled and written again


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


def test_a_new_sbatch_option_is_a_schema_field_a_base_yaml_line_and_a_table_row(
    tmp_path, monkeypatch, request
):
    """`slurm.reservation`, added in memory the way a real change would add it: a field in the
    schema's slurm section, its line in (a copy of) base.yaml, one row in plan.SBATCH_OPTIONS.
    Nothing else changes, and the option renders, its value is checked like every #SBATCH
    value, and a second copy in slurm.extra_sbatch_args is refused."""
    from rlflow.errors import RlflowError
    from rlflow.launch import plan
    from rlflow.launch.prepare import prepare
    from rlflow.recipe import schema
    from rlflow.recipe.values import hints

    @dataclass(frozen=True)
    class SlurmWithReservation(schema.SlurmConfig):
        reservation: str | None  # the new field

    monkeypatch.setattr(schema, "SlurmConfig", SlurmWithReservation)
    # The loader reads each class's type hints once per process: forget them now and after.
    hints.cache_clear()
    request.addfinalizer(hints.cache_clear)
    row = plan.SbatchOption("--reservation", "slurm.reservation", from_recipe=True)
    monkeypatch.setattr(plan, "SBATCH_OPTIONS", (*plan.SBATCH_OPTIONS, row))
    base = (REPO / "recipes" / "base.yaml").read_text()
    assert "\n  partition: null\n" in base
    (tmp_path / "base.yaml").write_text(
        base.replace("\n  partition: null\n", "\n  partition: null\n  reservation: null\n")
    )
    recipe = (
        (RECIPES / "tiny-cpu.yaml")
        .read_text()
        .replace("defaults: ../../../recipes/base.yaml", "defaults: base.yaml")
    )
    (tmp_path / "recipe.yaml").write_text(recipe)

    def dry_run(*overrides: str):
        flags = plan.SubmitFlags(nodes=1, gpus=1, command="true")
        return prepare(
            tmp_path / "recipe.yaml", overrides, flags, skip_pins=True, cwd=str(tmp_path)
        )

    assert "--reservation" not in dry_run().script  # null: left out, like every optional one
    sbatch_lines = dry_run("slurm.reservation=maint window").script.split("\nset -uo")[0]
    assert "\n#SBATCH --reservation='maint window'\n" in sbatch_lines
    with pytest.raises(RlflowError) as hostile:
        dry_run("slurm.reservation=a\\b")
    assert any(
        d.code == "submit.sbatch-value" and d.message.startswith("`slurm.reservation` is 'a\\\\b'")
        for d in hostile.value.diagnostics
    )
    with pytest.raises(RlflowError) as twice:
        dry_run("slurm.extra_sbatch_args=[--reservation=other]")
    assert (
        "`slurm.extra_sbatch_args[0]` sets --reservation, which rlflow sets from slurm.reservation"
    ) in [d.message for d in twice.value.diagnostics]
