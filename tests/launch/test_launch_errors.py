"""Bad recipes and flags: each error names the key, where it was set and the fix; nothing is
written and nothing reaches Slurm (these run as --dry-run, which runs every check)."""

from __future__ import annotations

import subprocess

import pytest

from tests.slurm.cluster import GPUS_PER_NODE, NUM_NODES
from tests.slurm.jobs import RECIPES, REPO, rlflow, write_recipe

TINY = str(RECIPES / "tiny-cpu.yaml")


def dry_run(tmp_path, *args: str, recipe: str = TINY):
    result = rlflow("submit", recipe, *args, "--dry-run", cwd=tmp_path)
    assert "---- script.sbatch" not in result.stdout  # nothing rendered for a bad recipe
    return result


def test_unknown_key_in_a_recipe_file(tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(f"defaults: {RECIPES / 'tiny-cpu.yaml'}\ngrpo:\n  max_num_stpes: 3\n")
    result = dry_run(tmp_path, "--nodes", "1", "--gpus", "1", recipe=str(recipe))
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error[recipe.unknown-key]: `grpo.max_num_stpes` is not a recipe key\n"
        "  --> typo.yaml:3:3\n"
        "  |\n"
        "3 |   max_num_stpes: 3\n"
        "  |   ^^^^^^^^^^^^^\n"
        "help: did you mean `grpo.max_num_steps`?"
    )


def test_override_with_a_wrong_type(tmp_path):
    result = dry_run(tmp_path, "grpo.max_num_steps=many", "--nodes", "1", "--gpus", "1")
    assert result.returncode == 2
    assert (
        "error[recipe.type]: `grpo.max_num_steps` is 'many', but must be an integer\n"
        "  --> command line `grpo.max_num_steps=many`"
    ) in result.stderr


def test_recipe_node_count_conflicts_with_the_flag(tmp_path):
    recipe = write_recipe(
        tmp_path / "four-nodes.yaml",
        {"cluster": {"num_nodes": 4}},
        defaults=RECIPES / "tiny-cpu.yaml",
    )
    result = dry_run(tmp_path, "--nodes", "8", "--gpus", "4", recipe=str(recipe))
    assert result.returncode == 2
    assert (
        "error[submit.cluster-conflict]: `cluster.num_nodes` is 4 in the recipe, but "
        "`--nodes 8` was given\n"
        "  --> four-nodes.yaml:"
    ) in result.stderr
    assert (
        "help: `--nodes` decides the job's shape: remove `cluster.num_nodes` from the recipe "
        "(submit fills it in), or pass `--nodes 4`"
    ) in result.stderr


def test_recipe_that_agrees_with_the_flags_is_fine(tmp_path):
    recipe = write_recipe(
        tmp_path / "agrees.yaml",
        {"cluster": {"num_nodes": 2, "gpus_per_node": 4}},
        defaults=RECIPES / "tiny-cpu.yaml",
    )
    result = rlflow("submit", str(recipe), "--nodes", "2", "--gpus", "4", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_parallel_size_that_does_not_divide_the_world_names_the_axis(tmp_path):
    result = dry_run(tmp_path, "parallelism.tensor_parallel_size=2", "--nodes", "1", "--gpus", "3")
    assert result.returncode == 2
    assert (
        "error[allocation.parallel-sizes]: parallel sizes multiply to 2, which does not divide the "
        "world size 3 (tensor_parallel_size=2)\n"
        "  --> command line `parallelism.tensor_parallel_size=2`"
    ) in result.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--time", "1h"], "error[submit.time]: `--time 1h` is not a Slurm time limit"),
        (["--after", "abc"], "error[submit.after]: `--after abc` is not a job id"),
        (
            ["--command", "python 'unbalanced"],
            "error[submit.command]: cannot split `--command python "
            "'unbalanced` into words: No closing quotation",
        ),
        (["--command", "  "], "error[submit.command]: `--command` is empty"),
    ],
)
def test_bad_flags(tmp_path, flags, message):
    result = dry_run(tmp_path, "--nodes", "1", "--gpus", "1", *flags)
    assert result.returncode == 2
    assert message in result.stderr


def test_time_limit_shorter_than_the_warning(tmp_path):
    result = dry_run(
        tmp_path, "slurm.signal_grace_seconds=300", "--time", "4", "--nodes", "1", "--gpus", "1"
    )
    assert result.returncode == 2
    assert (
        "error[recipe.range]: `slurm.signal_grace_seconds` (300) must be shorter than the time "
        "limit (240 s)"
    ) in result.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        (
            'run.name="two\\nlines"',
            "error[submit.sbatch-value]: `run.name` is 'two\\nlines': a newline, "
            "control character or backslash cannot go into an #SBATCH line",
        ),
        ("slurm.partition=a\\b", "error[submit.sbatch-value]: `slurm.partition` is 'a\\\\b'"),
        (
            "slurm.extra_sbatch_args=[--nodes=3]",
            "error[submit.extra-sbatch-arg]: "
            "`slurm.extra_sbatch_args[0]` sets --nodes, which rlflow sets from --nodes",
        ),
        (
            "slurm.extra_sbatch_args=[exclusive]",
            "`slurm.extra_sbatch_args[0]` is 'exclusive', which is not an sbatch option",
        ),
        (
            "slurm.container_mounts=[/a:/b]",
            "error[submit.container]: `slurm.container_mounts` is set, "
            "but `slurm.container_image` is null",
        ),
        (
            "run.output_dir=a-file/runs",
            "error[submit.output-dir]: cannot create the run directory under ",
        ),
        (
            "slurm.env={1BAD: x}",
            "error[recipe.env-name]: `slurm.env.1BAD` is not a valid environment variable name",
        ),
    ],
)
def test_values_that_cannot_reach_sbatch(tmp_path, override, message):
    (tmp_path / "a-file").write_text("a file where the run directory's parent would go\n")
    result = dry_run(tmp_path, override, "--nodes", "1", "--gpus", "1")
    assert result.returncode == 2
    assert message in result.stderr


def test_mount_with_a_comma(tmp_path):
    result = dry_run(
        tmp_path,
        "slurm.container_image=img",
        "slurm.container_mounts=['/a,b:/c']",
        "--nodes",
        "1",
        "--gpus",
        "1",
    )
    assert (
        "`slurm.container_mounts[0]` is '/a,b:/c': pyxis and apptainer separate mounts with "
        "commas" in result.stderr
    )


def test_every_problem_is_reported_at_once(tmp_path):
    result = dry_run(
        tmp_path,
        "parallelism.tensor_parallel_size=2",
        "slurm.extra_sbatch_args=[-t5]",
        "--nodes",
        "1",
        "--gpus",
        "3",
    )
    assert "error[allocation.parallel-sizes]" in result.stderr
    assert "error[submit.extra-sbatch-arg]" in result.stderr
    assert result.stderr.rstrip().endswith("2 errors, 1 warning")  # + "pin check not run"


def test_missing_recipe_and_missing_flags(tmp_path):
    missing = rlflow(
        "submit", "recipes/nope.yaml", "--nodes", "1", "--gpus", "1", "--dry-run", cwd=tmp_path
    )
    assert missing.returncode == 2
    assert (
        "error[recipe.not-found]: recipe file `recipes/nope.yaml` does not exist" in missing.stderr
    )
    no_nodes = rlflow("submit", TINY, "--gpus", "1", "--dry-run", cwd=tmp_path)
    assert no_nodes.returncode == 2 and "Missing option '--nodes'" in no_nodes.stderr
    zero = rlflow("submit", TINY, "--nodes", "0", "--gpus", "1", "--dry-run", cwd=tmp_path)
    assert zero.returncode == 2 and "0 is not in the range x>=1" in zero.stderr


def test_pin_drift_fails_the_dry_run_with_exit_1(drift_repo):
    result = rlflow("submit", TINY, "--nodes", "1", "--gpus", "1", "--dry-run", cwd=drift_repo)
    assert result.returncode == 1
    assert (
        "error[RF001]: conflicting git revs for `emerging-optimizers`: the root pins `v0.2.0`, "
        "submodule `submodules/dep` pins `v0.3.0`\n"
        f"  --> {drift_repo}/pyproject.toml:8:6"
    ) in result.stderr
    assert (
        f"error[submit.pins]: check-pins found 1 pin problem in {drift_repo}: not submitting\n"
        "help: fix them (`rlflow check-pins --fix` moves the root pins), or pass "
        "--skip-pin-check to submit anyway"
    ) in result.stderr
    skipped = rlflow(
        "submit",
        TINY,
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--dry-run",
        "--skip-pin-check",
        cwd=drift_repo,
    )
    assert skipped.returncode == 0
    assert "pins skipped (--skip-pin-check)" in skipped.stdout


# --- issue 15: bad input never ends in a traceback, a silent rewrite or a doomed job ----------


def test_a_collective_timeout_shorter_than_the_watchdog_is_refused_by_the_dry_run(tmp_path):
    result = dry_run(
        tmp_path,
        "watchdog.collective_timeout_s=60",
        "slurm.max_failure_retries=-1",
        "--nodes",
        "1",
        "--gpus",
        "1",
    )
    assert result.returncode == 2
    assert (
        "`watchdog.collective_timeout_s` (60) is shorter than `watchdog.phase_timeout_s` (600)"
        in result.stderr
    )
    assert "`slurm.max_failure_retries` must not be negative (it is -1)" in result.stderr
    assert "Traceback" not in result.stderr


def _no_traceback(result) -> None:
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "slurm.time_limit=12:00:00",
            "error[recipe.ambiguous]: `slurm.time_limit` is 12:00:00 without quotes, which YAML "
            "reads as the number 43200 (YAML 1.1, base 60)\n"
            "  --> command line `slurm.time_limit=12:00:00`\n"
            "help: did you mean '12:00:00'? quote it inside the shell's quotes: "
            "'slurm.time_limit=\"12:00:00\"'",
        ),
        ("slurm.mem=010", "`slurm.mem` is 010 without quotes, which YAML reads as the number 10"),
        ("optimizer.lr=.nan", "error[recipe.non-finite]: `optimizer.lr` is .nan"),
        ("rewards.format=.nan", "error[recipe.non-finite]: `rewards.format` is .nan"),
        ("loss.kl_penalty=.nan", "error[recipe.non-finite]: `loss.kl_penalty` is .nan"),
        (
            "slurm.rlflow_command=uv run 'rlflow",
            'error[recipe.rlflow-command]: `slurm.rlflow_command` is "uv run \'rlflow", which '
            "cannot be split into words: No closing quotation",
        ),
        (
            "run.name=" + "n" * 300,
            "error[submit.name-too-long]: `run.name` is 300 characters",
        ),
        (
            "run.output_dir=/proc/runs",
            "error[submit.output-dir]: cannot create the run directory under /proc/runs: "
            "No such file or directory",
        ),
    ],
)
def test_issue_15_inputs_are_diagnostics(tmp_path, override, message):
    result = dry_run(tmp_path, override, "--nodes", "1", "--gpus", "1")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    _no_traceback(result)


def test_override_hash_is_a_character_not_a_comment(tmp_path):
    result = rlflow(
        "submit",
        TINY,
        "slurm.partition=#gpu",
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--dry-run",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --partition='#gpu'\n" in result.stdout
    assert list(tmp_path.iterdir()) == []  # the writability probe left nothing behind


@pytest.mark.parametrize(
    "text, code",
    [
        ("", "recipe.empty"),
        ("# comments only\n", "recipe.empty"),
        ("grpo:\n  max_num_steps: 3\n", "recipe.missing-key"),
        ("a: &x [*x]\n", "recipe.yaml-alias"),
        (
            "a: &a [x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
            ),
            "recipe.yaml-alias",
        ),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "recipe.yaml-depth"),
    ],
    ids=["empty", "comments", "no-defaults", "self-alias", "alias-bomb", "5000-deep"],
)
def test_broken_recipe_files_are_diagnostics(tmp_path, text, code):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    result = rlflow("submit", str(path), "--nodes", "1", "--gpus", "1", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error[{code}]: ")
    assert "--> broken.yaml" in result.stderr
    assert len(result.stderr) < 20_000
    _no_traceback(result)


def test_real_submit_and_train_refuse_a_broken_recipe_the_same_way(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("# comments only\n")
    submitted = rlflow("submit", str(path), "--nodes", "1", "--gpus", "1", cwd=tmp_path)
    trained = rlflow("train", str(path), cwd=tmp_path)
    for result in (submitted, trained):
        assert result.returncode == 2, result.stderr
        assert "error[recipe.empty]: `broken.yaml` sets nothing\n  --> broken.yaml" in (
            result.stderr
        )
        _no_traceback(result)
    assert list(tmp_path.iterdir()) == [path]


def test_an_unknown_builtin_checkpoint_is_refused_by_the_dry_run_as_by_train(tmp_path):
    """One rule (rlflow.model.family.unknown_builtin), run by the recipe checks both use."""
    recipe = str(REPO / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml")
    override = "model.checkpoint=builtin:nope"
    dry = rlflow(
        "submit", recipe, override, "--nodes", "1", "--gpus", "1", "--dry-run", cwd=tmp_path
    )
    trained = rlflow("train", recipe, override, cwd=tmp_path)
    for result in (dry, trained):
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(
            "error[model.unknown-builtin]: `model.checkpoint` is `builtin:nope`, which names no "
            "built-in model\n"
            "  --> command line `model.checkpoint=builtin:nope`\n"
            "help: built-in models: builtin:tiny-qwen25vl, builtin:tiny-qwen3, "
            "builtin:tiny-qwen2vl, builtin:tiny-qwen3vl, builtin:tiny-qwen3vl-moe, "
            "builtin:tiny-qwen3-moe, builtin:tiny-nemotron-h, builtin:tiny-nemotron-h-moe, "
            "builtin:tiny-nemotron-omni; "
            "or set model.checkpoint to an HF checkpoint directory\n"
        )
        _no_traceback(result)
    assert "---- script.sbatch" not in dry.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
@pytest.mark.parametrize("content", ["abc; rm -rf /\n", "", "12 13\n", "\xff\xfe"])
def test_tampered_job_id_file_is_a_diagnostic(tmp_path, command, content):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job_id").write_bytes(content.encode("latin-1"))
    result = rlflow(command, str(run_dir), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error[jobs.job-id-file]: {run_dir}/job_id holds ")
    assert "not a Slurm job id" in result.stderr
    _no_traceback(result)


# --- against the real cluster: sbatch would accept these, and the job would never start --------


@pytest.mark.usefixtures("slurm_cluster")
def test_gpus_and_nodes_the_partition_cannot_give_are_refused(tmp_path):
    for extra in (["--dry-run"], []):
        five = rlflow(
            "submit",
            TINY,
            "run.name=refused-gpus5",
            "--nodes",
            "1",
            "--gpus",
            "5",
            *extra,
            cwd=tmp_path,
        )
        assert five.returncode == 2, five.stdout + five.stderr
        assert (
            "error[submit.gpus]: `--gpus 5`: no node in partition `debug` has 5 GPUs (the most "
            "is 4); Slurm would accept the job and never start it"
        ) in five.stderr
        assert "help: use --gpus 4 or fewer (and more --nodes)" in five.stderr
        _no_traceback(five)
    more = str(NUM_NODES + 1)
    too_many = rlflow("submit", TINY, "--nodes", more, "--gpus", "4", "--dry-run", cwd=tmp_path)
    assert too_many.returncode == 2
    assert (
        f"`--nodes {more}`: partition `debug` has only {NUM_NODES} nodes with 4 or more GPUs"
    ) in too_many.stderr
    fits = rlflow("submit", TINY, "--nodes", "8", "--gpus", "4", "--dry-run", cwd=tmp_path)
    assert fits.returncode == 0, fits.stderr
    assert (
        f"dry run: nothing submitted; checked against partition debug: {NUM_NODES} nodes, up to "
        f"{GPUS_PER_NODE} GPUs each (sinfo)"
    ) in fits.stdout
    assert not (tmp_path / "runs").exists()  # the refused real submit wrote nothing...
    queue = subprocess.run(
        ["squeue", "-h", "-t", "all", "-n", "refused-gpus5"], capture_output=True, text=True
    )
    assert queue.returncode == 0 and queue.stdout.strip() == ""  # ...and queued nothing
