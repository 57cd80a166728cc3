"""`recipe.server-in-job` (rlflow/rules/server.py): a server in the job that cannot run is
refused by the dry run, through the console script, naming the key and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.rules import load_checked

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
RLFLOW = str(Path(sys.executable).with_name("rlflow"))
ON = "generation.server.enabled=true"


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["generation.backend=hf"], "backend `hf` has none to serve"),
        (["parallelism.tensor_parallel_size=2"], "`parallelism.tensor_parallel_size` is 2"),
        (["parallelism.expert_parallel_size=2"], "`parallelism.expert_parallel_size` is 2"),
        (["generation.placement=separate", "generation.gpus_per_node=1",
          "generation.tensor_parallel_size=2"], "`generation.tensor_parallel_size` is 2"),
        (["generation.server.port=65530", "cluster.gpus_per_node=8"], "up to 65537"),
    ],
    ids=["backend", "tp", "ep", "separate-tp", "port-past-the-last"],
)  # fmt: skip
def test_a_server_it_cannot_run_is_refused(overrides, words):
    with pytest.raises(RlflowError) as caught:
        load_checked(TINY, [ON, *overrides])
    found = [d for d in caught.value.diagnostics if d.code == "recipe.server-in-job"]
    assert found and words in found[0].message, caught.value
    assert "generation.server.enabled=false" in found[0].help or "port" in found[0].help


def test_the_dry_run_refuses_it_and_passes_the_default(tmp_path):
    def dry_run(*overrides):
        return subprocess.run(
            [RLFLOW, "submit", str(TINY), *overrides, "--nodes", "1", "--gpus", "1",
             "--dry-run", "--skip-pin-check"],
            capture_output=True, text=True, cwd=tmp_path, timeout=120,
        )  # fmt: skip

    refused = dry_run(ON, "parallelism.expert_parallel_size=2")
    assert refused.returncode == 2 and "error[recipe.server-in-job]" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert dry_run(ON).returncode == 0
