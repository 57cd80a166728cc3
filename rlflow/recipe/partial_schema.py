"""The recipe's `generation.partial_rollouts` section: a per-step generation budget, unfinished
rows continuing in the next step (docs/partial-rollouts.md). Its own module, beside
rlflow/recipe/schema.py (which imports it), so the section reads in one place."""

from __future__ import annotations

from dataclasses import field

from rlflow.frozen import frozen
from rlflow.recipe.bounds import bound


@frozen
class PartialRolloutsConfig:
    enabled: bool  # rows unfinished at the budget keep their tokens and continue next step
    # decode steps one step's generation runs at most; 0: no step budget (max_new_tokens)
    budget_steps: int = field(metadata=bound(ge=0, help="0: no decode-step budget"))
    # a pass stops once this share of its rows finished (1.0: every row, no early stop)
    finished_fraction: float = field(
        metadata=bound(gt=0, le=1, help="1.0 waits for every row; 0.9 stops at 90% finished")
    )
    # a row whose first token is more than this many weight updates old starts over
    max_staleness_steps: int = field(metadata=bound(ge=0, help="0: a row must finish in one step"))
