"""What the trainer reads off a policy's logits besides log-probabilities: the entropy.

Used by the packed forward (rlflow/model/packed_forward.py) and the GRPO update (through
rlflow/train/grpo.py), so it lives at the model layer, below both.
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy (nats) of softmax(logits) per position, (B, T), in fp32.

    -sum p log p via log_softmax; entries with p = 0 (e.g. -inf logits) contribute exactly 0
    and no NaN gradient.
    """
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    p_BTV = logp_BTV.exp()
    return -(p_BTV * logp_BTV.masked_fill(p_BTV == 0, 0.0)).sum(-1)
