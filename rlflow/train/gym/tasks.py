"""NeMo Gym's tasks for a run: the rows (`responses_create_params`, ...) and which a step runs.

`environment.gym.tasks` is a JSONL file of Gym rows, or the name of one of the agent's
`datasets` in its Gym config (its `jsonl_fpath`, relative to the working directory or Gym's
install). A step runs `grpo.num_prompts_per_step` tasks, each `num_generations_per_prompt`
times; tasks are drawn without replacement from a permutation per epoch, seeded by `run.seed`,
so a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError


def tasks_path(config, cfg) -> Path:
    """The JSONL file `environment.gym.tasks` names."""
    import nemo_gym

    if cfg.tasks.endswith(".jsonl"):
        return Path(cfg.tasks)
    [(_, inner)] = config[cfg.agent].items()
    [(_, agent)] = inner.items()
    datasets = {d.get("name"): d for d in agent.get("datasets") or []}
    if cfg.tasks not in datasets:
        raise _error(
            f"environment.gym.tasks={cfg.tasks!r} is neither a .jsonl file nor a dataset of "
            f"agent {cfg.agent} (it has {sorted(datasets)})"
        )
    relative = Path(datasets[cfg.tasks]["jsonl_fpath"])
    local = Path.cwd() / relative
    return local if local.is_file() else Path(nemo_gym.PARENT_DIR) / relative


def load_tasks(path: Path) -> list[dict]:
    if not path.is_file():
        raise _error(f"the Gym tasks file {path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise _error(f"{path}:{n}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("responses_create_params"), dict):
            raise _error(f"{path}:{n}: a Gym row needs a `responses_create_params` object")
        rows.append(row)
    if not rows:
        raise _error(f"the Gym tasks file {path} has no rows")
    return rows


def step_tasks(n_tasks: int, step: int, per_step: int, seed: int) -> list[int]:
    """The task indices of step `step` (1-based)."""
    out = []
    for i in range((step - 1) * per_step, step * per_step):
        epoch, at = divmod(i, n_tasks)
        order = list(range(n_tasks))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(order[at])
    return out


def request_row(task: dict, gen) -> dict:
    """The task as the agent's /run takes it, sampled as `generation` says."""
    row = copy.deepcopy(task)
    params = row["responses_create_params"]
    params["max_output_tokens"] = gen.max_new_tokens
    params["temperature"] = gen.temperature
    params["top_p"] = gen.top_p
    return row


def _error(message: str) -> RlflowError:
    return RlflowError(
        Diagnostic(
            "gym.tasks",
            message,
            help="set environment.gym.tasks to a JSONL file of Gym rows, or to a dataset name of "
            "the agent's config (e.g. example)",
        )
    )
