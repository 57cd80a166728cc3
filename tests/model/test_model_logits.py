"""Vocab-parallel logprobs and entropy (rlflow/model/logits.py) equal the full-vocabulary math.

One process checks the math against log_softmax; two gloo ranks, each holding half of the
vocabulary's logits, check that the values and the gradients of each half equal the
full-vocabulary ones, without any rank ever holding the whole vocabulary.
"""

from __future__ import annotations

import socket

import torch

from rlflow.model.logits import entropy_from_logits, vocab_parallel_logprobs

ROWS, VOCAB = 7, 40


def _inputs(seed: int = 0):
    """Logits [ROWS, VOCAB] with a few -inf entries (a masked vocabulary), targets, weights."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=g, dtype=torch.float64) * 3
    logits[0, :5] = float("-inf")
    logits[3, VOCAB // 2 :] = float("-inf")  # rank 1's half of this row is all -inf
    targets = torch.randint(5, VOCAB // 2, (ROWS,), generator=g)
    targets[1], targets[2] = VOCAB - 1, VOCAB // 2  # targets on the second half too
    weights = torch.randn(2, ROWS, generator=g, dtype=torch.float64)
    return logits, targets, weights


def _reference(logits, targets, weights):
    """Values and the logits' gradient by autograd through torch.log_softmax."""
    x = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(x, -1)
    lp = logp.gather(1, targets[:, None])[:, 0]
    entropy = entropy_from_logits(x[None])[0].double()
    ((weights[0] * lp).sum() + (weights[1] * entropy).sum()).backward()
    return lp.detach(), entropy.detach(), x.grad


def _ours(logits, targets, weights, group=None):
    x = logits.clone().requires_grad_(True)
    lp, entropy = vocab_parallel_logprobs(x, targets, with_entropy=True, group=group)
    ((weights[0] * lp).sum() + (weights[1] * entropy).sum()).backward()
    return lp.detach(), entropy.detach(), x.grad


def test_logprobs_entropy_and_gradients_equal_log_softmax():
    logits, targets, weights = _inputs()
    for want, got in zip(_reference(logits, targets, weights), _ours(logits, targets, weights)):
        assert torch.allclose(got.double(), want.double(), atol=1e-5), (got, want)


def test_entropy_is_optional_and_shapes_follow_the_targets():
    logits, targets, _ = _inputs()
    lp, entropy = vocab_parallel_logprobs(
        logits.float().view(1, ROWS, VOCAB), targets.view(1, ROWS), with_entropy=False, group=None
    )
    assert entropy is None and lp.shape == (1, ROWS) and lp.dtype == torch.float32
    assert torch.all(torch.isfinite(lp))


def _two_ranks(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    logits, targets, weights = _inputs()
    half = VOCAB // 2
    shard = logits[:, rank * half : (rank + 1) * half].float()
    lp, entropy, grad = _ours(shard, targets, weights, group=dist.group.WORLD)
    torch.save({"logprobs": lp, "entropy": entropy, "grad": grad}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_with_half_the_vocabulary_each_equal_the_whole(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_ranks, args=(port, str(tmp_path)), nprocs=2)
    logits, targets, weights = _inputs()
    lp, entropy, grad = _reference(logits, targets, weights)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for got in ranks:  # every rank holds every row's values
        assert torch.allclose(got["logprobs"].double(), lp, atol=1e-5)
        assert torch.allclose(got["entropy"].double(), entropy, atol=1e-5)
    whole = torch.cat([r["grad"] for r in ranks], dim=1)  # each rank: its half's gradient
    assert whole.shape == grad.shape
    assert torch.allclose(whole.double(), grad, atol=1e-5)
