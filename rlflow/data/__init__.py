"""Datasets, prompts and rewards shared by the trainer and the generation backends.

The names below load their module on first use, so `import rlflow.data.rewards` (recipe
checks on login nodes) pulls in neither PIL nor torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Sample": "rlflow.data.sample",
    "build_dataset": "rlflow.data.dataset",
    "PromptSampler": "rlflow.data.sampler",
    "to_messages": "rlflow.data.prompts",
    "reference_completion": "rlflow.data.prompts",
    "REWARDS": "rlflow.data.rewards",
    "register_reward": "rlflow.data.rewards",
    "score": "rlflow.data.scoring",
    "RewardError": "rlflow.data.rewards",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlflow.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
