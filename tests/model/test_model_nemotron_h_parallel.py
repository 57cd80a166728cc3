"""Nemotron-H on two gloo ranks (`builtin:tiny-nemotron-h-moe`: Mamba, MoE, attention and MLP
layers, fp32 on the CPU) equals one rank: under TP 2 (the Mamba mixer's heads and groups, the
attention heads, the MLPs and the shared experts split; the MoE layers dispatch half the tokens
a rank, the experts split over TP too) and under EP 2 (4 of the 8 experts a rank, tokens by
all-to-all, 2 data-parallel ranks). Each rank computes the packed trainer's logprobs of the same
rows and the gradients of a weighted sum of them (/ the data-parallel size: megatron sums
gradients over data-parallel ranks), exported through megatron-bridge as whole HF tensors. CP
and PP are refused at load."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlflow.errors import RlflowError
from tests.tiny import FP32, init_layout, spawned_rank

LAYOUTS = {"tp2": (2, 1), "ep2": (1, 2)}  # name: (TP, EP)
ROWS = [[5, 17, 23, 9, 41, 7, 12, 30, 11], [8, 3, 19, 27], [14, 6, 33, 2, 25, 18, 4]]


def _batch():
    width = max(len(r) for r in ROWS)
    ids = torch.zeros(len(ROWS), width, dtype=torch.long)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, row in enumerate(ROWS):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    return ids, mask


def cycle(checkpoint: Path, parallel_cfg) -> dict:
    """Logprobs and the exported gradients of sum(w * logprobs) / DP."""
    from megatron.core.distributed import finalize_model_grads

    from rlflow import parallel
    from rlflow.model.build import export_hf_state_dict, load_policy
    from rlflow.model.media import Media
    from rlflow.model.packed_forward import pack_rows, target_logprobs
    from rlflow.train.update import _backward

    # no load-balancing loss: megatron-core computes it over each rank's own tokens
    model_cfg = dataclasses.replace(FP32, moe=dataclasses.replace(FP32.moe, aux_loss_coeff=0.0))
    policy = load_policy(checkpoint, model_cfg, parallel_cfg, trainable=True)
    ids, mask = _batch()
    targets = mask[:, 1:] & mask[:, :-1]
    packed = pack_rows(policy.core, ids, mask, mask, targets, [Media()] * len(ROWS))
    chunk = policy.chunks[0]
    chunk.zero_grad_buffer()
    lp, _ = target_logprobs(policy.core, packed, (None, None), with_entropy=False)
    weights = torch.linspace(-1.0, 1.0, lp.numel())
    _backward((lp * weights).sum() / parallel.info().dp_size)
    finalize_model_grads(policy.chunks)
    with torch.no_grad():
        for param in chunk.module.parameters():
            param.copy_(param.main_grad)  # export the gradients as if they were weights
    return {"logprobs": lp.detach(), "grads": export_hf_state_dict(policy)}


def _rank(rank: int, checkpoint: str, out: str, port: int) -> None:
    spawned_rank(rank, 2, port)
    from megatron.core import parallel_state

    from rlflow import parallel
    from rlflow.recipe.schema import ParallelismConfig

    results = {}
    for name, (tp, ep) in LAYOUTS.items():
        layout = ParallelismConfig(tp, 1, 1, ep, "off")
        init_layout(layout)
        results[name] = cycle(Path(checkpoint), layout)
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(results, out)
    parallel.shutdown()


def test_tensor_and_expert_parallel_equal_one_rank(single_rank, family_ckpt, tmp_path):
    import torch.multiprocessing as mp

    from rlflow.parallel import _free_port
    from tests.tiny import SINGLE

    checkpoint = family_ckpt("tiny-nemotron-h-moe")
    reference = cycle(checkpoint, SINGLE)
    out = tmp_path / "rank0.pt"
    mp.start_processes(
        _rank, args=(str(checkpoint), str(out), _free_port()), nprocs=2, start_method="spawn"
    )
    results = torch.load(out)
    for name, result in results.items():
        assert (result["logprobs"] - reference["logprobs"]).abs().max() < 1e-5, name
        assert sorted(result["grads"]) == sorted(reference["grads"])
        for key, grad in reference["grads"].items():
            gap = float((result["grads"][key] - grad).abs().max())
            assert gap <= 1e-5 * max(1.0, float(grad.abs().max())), (name, key, gap)
    mixer = "backbone.layers.0.mixer."
    assert reference["grads"][mixer + "A_log"].abs().sum() > 0  # the mixers really train


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ({"context_parallel_size": 2}, "parallelism.context_parallel_size: 2"),
        ({"pipeline_model_parallel_size": 2}, "parallelism.pipeline_parallel_size: 2"),
        ({"sequence_parallel": True}, "parallelism.sequence_parallel: on"),
    ],
)
def test_context_pipeline_and_sequence_parallel_are_refused(layout, named):
    from types import SimpleNamespace

    from rlflow.model.families.nemotron_h.model import check_parallelism

    sizes = dict(
        tensor_model_parallel_size=2, context_parallel_size=1, pipeline_model_parallel_size=1,
        sequence_parallel=False,
    )  # fmt: skip
    with pytest.raises(RlflowError) as raised:
        check_parallelism(SimpleNamespace(**{**sizes, **layout}))
    (diagnostic,) = raised.value.diagnostics
    assert diagnostic.code == "model.nemotron-h-parallelism" and named in diagnostic.message
