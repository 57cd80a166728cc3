"""A pass of hostile values over every key of recipes/base.yaml (issue 36, "Done when").

Each key gets values of the wrong kind for it, a negative or empty one, a huge one, NaN or
infinity, shell syntax, and a key nested under it that does not exist. Each case is accepted or
refused with errors of one line that name a key; nothing raises anything but the RlflowError the
CLI prints. The bulk runs train's check path in-process (`load_checked`, then the allocation
rules: what `submit --dry-run` runs before its sbatch checks, tests/rules/test_rules_allocation.py
holds them equal); a sample goes through the console script, which must exit 0 or 2 with no
traceback. The pass found: keys nothing read where they were set (the shipped 3B and 30B recipes'
micro_batch_size beside a token budget), unbounded token counts, row counts, image sizes, worker
counts and buffer sizes, negative Adam betas and eps, negative MoE loss weights, and MoE keys on
dense models.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rlflow.errors import RlflowError
from rlflow.rules import load_checked
from rlflow.rules.allocation import allocation_diagnostics

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = str(ROOT / ".venv" / "bin" / "rlflow")
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
MAPPINGS = {"env", "mix", "rewards"}  # their keys are the user's: any name is a key
SHELL = "'$(touch /tmp/rlflow-pwned); `id` && rm -rf ~'"
# Keys whose size is memory (tokens, rows, pixels, processes, buffers): a trillion is refused
# before the job, not met as an allocation error or a hang on every rank.
MEMORY_SIZED = {
    "data.train.num_samples",
    "data.validation.num_samples",
    "data.image_size",
    "data.max_prompt_tokens",
    "scoring.num_workers",
    "grpo.num_prompts_per_step",
    "grpo.num_generations_per_prompt",
    "warm_start.batch_size",
    "generation.max_new_tokens",
    "generation.max_batch_size",
    "generation.vllm.kv_cache_space_gb",
    "generation.sync_bucket_mb",
}


def _keys(section: dict, path: tuple[str, ...] = ()):
    for key, value in section.items():
        if isinstance(value, dict) and key not in MAPPINGS:
            yield from _keys(value, (*path, key))
        else:
            yield ".".join((*path, key)), value


def _hostile(key: str, default) -> list[tuple[str, bool]]:
    """(override, must it be refused) for one key, chosen by what its default is."""
    if isinstance(default, bool):
        values = [("2", True), ("'yes please'", True), ("[true]", True)]
    elif isinstance(default, int | float):
        negative_ok = key.endswith("seed")  # (a seed is any 64-bit number)
        huge = ("1000000000000", key in MEMORY_SIZED)
        values = [("abc", True), ("-1", not negative_ok), ("0", False), huge]
        values += [("nan", True), ("inf", True), ("-inf", True), ("[1, 2]", True)]
    elif isinstance(default, list | dict):
        values = [("''", False), ("7", False), (SHELL, False), ("{a: [1, {b: 2}]}", False)]
    else:  # strings, and null defaults (a string, a number or null by key)
        values = [("''", False), (SHELL, False), ("1.5e400", False), ("'{a: 1}'", False)]
        values += [("[1, 2]", True)]
    cases = [(f"{key}={value}", refused) for value, refused in values]
    if not isinstance(default, dict) or key.rsplit(".", 1)[-1] not in MAPPINGS:
        cases.append((f"{key}.not_a_key=1", True))
    return cases


BASE = yaml.safe_load((ROOT / "recipes" / "base.yaml").read_text())
CASES = [case for key, default in _keys(BASE) for case in _hostile(key, default)]


def _outcome(override: str) -> list:
    """The errors train's setup path reports for the tiny recipe with `override` (1 x 1)."""
    try:
        loaded = load_checked(TINY, [override])
    except RlflowError as err:
        return [d for d in err.diagnostics if d.severity == "error"]
    return [d for d in allocation_diagnostics(loaded, 1, 1) if d.severity == "error"]


def _names_a_key(error, override: str) -> bool:
    """The error names a key (`dotted.key`), this key by its name, or points at the override."""
    key = override.split("=", 1)[0].split(".")
    said = "`" in error.message or key[-1] in error.message
    return said or error.file == f"command line `{override}`"


def test_every_key_takes_hostile_values_without_a_traceback():
    assert len(CASES) >= 700, len(CASES)  # (every key of base.yaml, several values each)
    wrong = []
    for override, must_refuse in CASES:
        try:
            errors = _outcome(override)
        except Exception as exc:  # a traceback the user would see
            wrong.append(f"{override}: raised {exc!r}")
            continue
        if must_refuse and not errors:
            wrong.append(f"{override}: accepted")
        for error in errors:
            if "\n" in error.message or not _names_a_key(error, override):
                wrong.append(f"{override}: {error.message!r} (one line, naming the key)")
    assert not wrong, "\n".join(wrong)
    assert not Path("/tmp/rlflow-pwned").exists()


@pytest.mark.parametrize(
    "override",
    [
        "generation.max_new_tokens=nan",
        "data.max_prompt_tokens=-1",
        "data.image_size=1000000000000",
        "scoring.num_workers=1000000000000",
        f"slurm.partition={SHELL}",
        f"run.name={SHELL}",
        "slurm.env={A: 1e999}",
        "model.moe.router_topk=-1",
        "grpo.not_a_key=1",
        "optimizer.lr=inf",
        "slurm.time_limit=''",
        "logging.wandb.tags=[a, [b]]",
    ],
)
def test_the_console_script_exits_0_or_2_without_a_traceback(tmp_path, override):
    result = subprocess.run(
        [RLFLOW, "submit", str(TINY), override, "--dry-run", "--nodes", "1", "--gpus", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    if result.returncode == 2:
        first = next(line for line in result.stderr.splitlines() if line.startswith("error"))
        assert "`" in first  # the key, named on the error's own line
    assert not list(tmp_path.iterdir())  # a dry run writes nothing
    assert not Path("/tmp/rlflow-pwned").exists()
