"""`slurm.container.runtime`: pyxis (the default, unchanged: the pyxis golden files), apptainer
(`apptainer exec --nv --bind=... IMAGE` before every srun step; golden file apptainer-2n4g.txt)
and none; the rules that tie the runtime to the image. Named to sort after
test_launch_dry_run.py, whose golden dry runs must run before this session's cluster exports
SLURM_CONF.

Neither apptainer nor singularity can run here: Debian 12's archive has no package for either
(`apt-cache policy apptainer singularity-container`: no candidate; `apt-cache search`: nothing).
So the real-cluster test runs the rendered script with a stand-in executable in
`slurm.container.apptainer_command`: it records the arguments the script passed (those are what
rlflow is responsible for) and runs the command after the image on the node, as
`apptainer exec` would inside it.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.slurm.jobs import PYTHON, RECIPES, batch_log, rlflow, submit, wait_done, write_recipe

TINY = RECIPES / "tiny-cpu.yaml"


def dry_run(tmp_path, *args: str):
    return rlflow(
        "submit", str(TINY), *args, "--nodes", "1", "--gpus", "2", "--dry-run", cwd=tmp_path
    )


def test_unknown_runtime_names_the_key_and_the_choices(tmp_path):
    result = dry_run(tmp_path, "slurm.container.runtime=docker")
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error[recipe.type]: `slurm.container.runtime` is 'docker', but must be "
        "'pyxis' | 'apptainer' | 'none'\n"
        "  --> command line `slurm.container.runtime=docker`"
    )
    assert "---- script.sbatch" not in result.stdout


def test_apptainer_needs_an_image(tmp_path):
    result = dry_run(tmp_path, "slurm.container.runtime=apptainer")
    assert result.returncode == 2
    assert (
        "error[submit.container]: `slurm.container.runtime` is apptainer, but "
        "`slurm.container_image` is null\n"
        "  --> command line `slurm.container.runtime=apptainer`\n"
        "help: set slurm.container_image to a .sif file or a docker:// image, or set "
        "slurm.container.runtime: none to run on the host"
    ) in result.stderr


def test_runtime_none_with_an_image_is_a_contradiction(tmp_path):
    result = dry_run(tmp_path, "slurm.container.runtime=none", "slurm.container_image=x.sqsh")
    assert result.returncode == 2
    assert (
        "error[submit.container]: `slurm.container.runtime` is none, but "
        "`slurm.container_image` is 'x.sqsh'"
    ) in result.stderr


def test_runtime_none_and_the_default_pyxis_without_image_run_on_the_host(tmp_path):
    scripts = []
    for runtime in ("none", "pyxis"):
        result = dry_run(tmp_path, f"slurm.container.runtime={runtime}")
        assert result.returncode == 0, result.stderr
        script = result.stdout.split("# ---- recipe.yaml")[0]
        scripts.append(re.sub(r"-\d{8}-\d{6}-[0-9a-f]{6}", "-<STAMP>", script))
    assert scripts[0] == scripts[1]
    assert "--container-image" not in scripts[0] and "apptainer" not in scripts[0]


@pytest.mark.parametrize("gpus", [True, False])
def test_apptainer_words_are_quoted_and_nv_follows_the_gpu_request(tmp_path, gpus):
    image = "/images/a b'; touch pwned #.sif"
    result = dry_run(
        tmp_path,
        "slurm.container.runtime=apptainer",
        f"slurm.container_image={image}",
        f"slurm.request_gpus={str(gpus).lower()}",
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("in_container=("))
    words = shlex.split(line.removeprefix("in_container=(").removesuffix(")"))
    assert words == ["apptainer", "exec", *(["--nv"] if gpus else []), image]
    assert '  srun "${srun_flags[@]}" "${in_container[@]}" "$@" &' in result.stdout


STAND_IN = """#!{python}
# Stands in for `apptainer` (not installable here): records its arguments, then runs what
# follows the image, as `apptainer exec ... IMAGE COMMAND...` runs COMMAND in the image.
import json, os, sys
args = sys.argv[1:]
image = args.index({image!r})
with open(os.path.join({out!r}, "call-%d.json" % os.getpid()), "w") as f:
    json.dump(args[: image + 1], f)
os.execvp(args[image + 1], args[image + 1 :])
"""


@pytest.mark.usefixtures("slurm_cluster")
def test_apptainer_script_runs_every_step_through_the_runtime(tmp_path):
    out = tmp_path / "calls"
    out.mkdir()
    image = str(tmp_path / "images" / "torch 25.01.sif")
    stand_in = tmp_path / "bin" / "fake apptainer"
    stand_in.parent.mkdir()
    stand_in.write_text(STAND_IN.format(python=PYTHON, image=image, out=str(out)))
    stand_in.chmod(0o755)
    recipe = write_recipe(
        tmp_path / "apptainer.yaml",
        {
            "slurm": {
                "container_image": image,
                "container_mounts": [f"{tmp_path}/data dir:/data:ro"],
                "container": {
                    "runtime": "apptainer",
                    "apptainer_command": shlex.quote(str(stand_in)),
                    "apptainer_args": ["--cleanenv"],
                },
                "setup_command": "echo setup on $SLURMD_NODENAME",
            }
        },
        defaults=TINY,
    )
    job, run_dir = submit(
        recipe, "--nodes", "2", "--gpus", "2", cwd=tmp_path,
        command="bash -c 'echo rank $RANK of $WORLD_SIZE'",
    )  # fmt: skip
    fields = wait_done(job, 300, run_dir)
    assert fields["JobState"] == "COMPLETED", batch_log(run_dir, job)
    calls = [json.loads(p.read_text()) for p in out.glob("call-*.json")]
    # Two steps (setup, training) on two nodes each, every one through the runtime.
    assert len(calls) == 4
    assert {tuple(c) for c in calls} == {
        ("exec", "--nv", f"--bind={tmp_path}/data dir:/data:ro", "--cleanenv", image)
    }
    assert "setup on node1" in batch_log(run_dir, job)
    for rank in range(4):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert f"rank {rank} of 4" in log
