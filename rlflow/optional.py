"""Optional packages a recipe can turn on, asked about without importing them (importing wandb
takes seconds). The dry run and `rlflow train` share these rules (rlflow/rules/checks.py);
rlflow/train/wandb_log.py uses the package once the run starts. Standard library only.
"""

from __future__ import annotations

import importlib.util

WANDB_INSTALL_HELP = (
    "install it where the job runs: `uv sync --extra wandb` (or `pip install 'rlflow[wandb]'`); "
    "or set logging.wandb.enabled: false"
)


def wandb_missing(cfg) -> bool:
    """True if the recipe turns W&B on (`logging.wandb`) but the wandb package is not installed."""
    return cfg.enabled and cfg.mode != "disabled" and importlib.util.find_spec("wandb") is None


GYM_INSTALL_HELP = (
    "install NeMo Gym where the job runs: `uv sync --extra gym` (or `pip install 'rlflow[gym]'`); "
    "or set environment.kind: single_turn"
)


def gym_root():
    """NeMo Gym's install root (its resources_servers/, responses_api_agents/, ... folders), or
    None when the `gym` extra is not installed. Nothing is imported to ask."""
    from pathlib import Path

    spec = importlib.util.find_spec("nemo_gym")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent
