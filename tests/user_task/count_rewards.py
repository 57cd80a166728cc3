"""A user's reward module, as a user would write it: plain functions of one RewardBatch.

The recipe names them by import path (`count_rewards:counting`), found from the directory
`rlflow train` runs in.
"""

from __future__ import annotations

import re

from rlflow.data.rewards import RewardBatch

ANSWER = re.compile(r"<answer>\s*(\d+)\s*</answer>")


def counting(batch: RewardBatch) -> dict[str, list[float]]:
    """Two components, each logged as its own metric (train/reward_count_rewards:counting/...):
    correct: the answer's number equals the reference;
    plausible: the answer is a count the scene allows (1..objects, from the `objects` column).
    """
    correct, plausible = [], []
    for completion, answer, fields in zip(batch.completions, batch.answers, batch.fields):
        found = ANSWER.fullmatch(completion.strip())
        got = int(found[1]) if found else None
        correct.append(1.0 if got is not None and str(got) == answer else 0.0)
        plausible.append(0.2 if got is not None and 1 <= got <= fields["objects"] else 0.0)
    return {"correct": correct, "plausible": plausible}


def finished(batch: RewardBatch) -> list[float]:
    """1 when the model stopped by itself (EOS) within its token budget, else 0."""
    return [
        1.0 if reason == "stop" and tokens <= 8 else 0.0
        for reason, tokens in zip(batch.finish_reasons, batch.completion_tokens)
    ]
