"""rlflow/compat/mamba_reference.py: the chunked Mamba-2 scan and the causal conv equal naive
loops, packed rows (seq_idx / cu_seqlens) equal rows run alone, and decode steps continue a
prefill exactly. Plain torch on CPU: these are the kernels the CPU runs."""

from __future__ import annotations

import torch

from rlflow.compat import mamba_reference as ref


def _inputs(batch=2, length=23, heads=4, headdim=8, groups=2, dstate=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, headdim, generator=g)
    dt = torch.randn(batch, length, heads, generator=g)
    A = -torch.rand(heads, generator=g) * 2 - 0.1
    B = torch.randn(batch, length, groups, dstate, generator=g)
    C = torch.randn(batch, length, groups, dstate, generator=g)
    D = torch.randn(heads, generator=g)
    z = torch.randn(batch, length, heads, headdim, generator=g)
    bias = torch.randn(heads, generator=g)
    return x, dt, A, B, C, D, z, bias


def test_chunked_scan_equals_the_sequential_recurrence_with_and_without_rows():
    x, dt, A, B, C, D, z, bias = _inputs()
    init = torch.randn(2, 4, 8, 16)
    want, want_state = ref.sequential_scan(
        x, dt, A, B, C, D, z, bias, dt_softplus=True, initial_states=init
    )
    for chunk in (4, 7, 64):  # chunks smaller than, not dividing, and longer than the sequence
        got, state = ref.mamba_chunk_scan_combined(
            x, dt, A, B, C, chunk, D=D, z=z, dt_bias=bias, dt_softplus=True,
            initial_states=init, return_final_states=True,
        )  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)
    # packed rows: boundaries mid-chunk and on a chunk edge
    seq_idx = torch.tensor([[0] * 5 + [1] * 8 + [2] * 10, [0] * 12 + [1] * 11], dtype=torch.int32)
    want, _ = ref.sequential_scan(x, dt, A, B, C, D, z, bias, dt_softplus=True, seq_idx=seq_idx)
    got = ref.mamba_chunk_scan_combined(
        x, dt, A, B, C, 4, D=D, z=z, dt_bias=bias, dt_softplus=True, seq_idx=seq_idx
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_packed_rows_equal_rows_run_alone_conv_and_scan():
    x, dt, A, B, C, D, z, bias = _inputs(batch=1)
    lengths = [6, 9, 8]
    cu = torch.tensor([0, 6, 15, 23], dtype=torch.int32)
    seq_idx = ref.seq_idx_of(cu)
    assert seq_idx.tolist() == [[0] * 6 + [1] * 9 + [2] * 8]
    weight, cbias = torch.randn(32, 4), torch.randn(32)
    xs = torch.randn(1, 32, 23)
    packed_conv = ref.causal_conv1d_fn(xs, weight, cbias, seq_idx=seq_idx, activation="silu")
    packed = ref.mamba_chunk_scan_combined(
        x, dt, A, B, C, 4, D=D, z=z, dt_bias=bias, dt_softplus=True, cu_seqlens=cu
    )
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        alone = ref.causal_conv1d_fn(xs[..., rows], weight, cbias, activation="silu")
        torch.testing.assert_close(packed_conv[..., rows], alone)
        part = [t[:, rows] for t in (x, dt, B, C, z)]
        alone = ref.mamba_chunk_scan_combined(
            part[0], part[1], A, part[2], part[3], 4, D=D, z=part[4], dt_bias=bias,
            dt_softplus=True,
        )  # fmt: skip
        torch.testing.assert_close(packed[:, rows], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_conv_equals_torch_conv1d_and_decode_steps_continue_the_prefill():
    torch.manual_seed(0)
    xs, weight, cbias = torch.randn(2, 12, 10), torch.randn(12, 4), torch.randn(12)
    want = torch.nn.functional.conv1d(xs, weight[:, None], cbias, padding=3, groups=12)[..., :10]
    got = ref.causal_conv1d_fn(xs, weight, cbias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # conv decode: the state holds the last W inputs
    state = xs[:, :, 6:10].clone()
    new = torch.randn(2, 12)
    step = ref.causal_conv1d_update(new, state, weight, cbias, activation="silu")
    full = ref.causal_conv1d_fn(
        torch.cat([xs, new[..., None]], -1), weight, cbias, activation="silu"
    )
    torch.testing.assert_close(step, full[..., -1], rtol=1e-5, atol=1e-5)
    # SSM decode: the prefill's final state, then one token, equals the scan over all tokens
    x, dt, A, B, C, D, z, bias = _inputs(length=9)
    y, state = ref.mamba_chunk_scan_combined(
        x[:, :8], dt[:, :8], A, B[:, :8], C[:, :8], 4, D=D, z=z[:, :8], dt_bias=bias,
        dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    full = ref.mamba_chunk_scan_combined(
        x, dt, A, B, C, 4, D=D, z=z, dt_bias=bias, dt_softplus=True
    )
    last = ref.selective_state_update(
        state, x[:, 8], dt[:, 8], A, B[:, 8], C[:, 8], D=D, z=z[:, 8], dt_bias=bias,
        dt_softplus=True,
    )  # fmt: skip
    torch.testing.assert_close(last, full[:, 8], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, full[:, :8], rtol=1e-5, atol=1e-5)


def test_triton_forward_rows_and_chunks_follow_the_packed_rows():
    """The Triton forward path (GPU, outside autograd) reads the packed rows from seq_idx: row
    starts over the flattened batch, and chunks aligned to each row's start, so no chunk spans
    two rows. On a CPU, or with autograd on, the reference runs (the GPU check compares them:
    benchmarks/nemotron_h_moe_gpu_check.py)."""
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2]])
    starts = ref._row_starts(seq_idx, 1, 10)
    assert starts == [0, 3, 5, 10]
    assert ref._row_starts(None, 2, 4) == [0, 4, 8]
    bounds, last, rows = ref.varlen_chunks(starts, 2)
    assert bounds == [0, 2, 3, 5, 7, 9, 10]
    assert rows == [0, 0, 1, 2, 2, 2]
    assert last == [1, 2, 5]
    with torch.no_grad():
        assert ref._triton_forward(torch.zeros(1)) is None  # CPU tensors: the reference


def test_mamba_ssm_training_kernel_only_for_cuda_tensors_under_autograd():
    """The update's scan leaves the reference for mamba-ssm's Triton forward and backward only
    for a CUDA tensor under autograd (and only where mamba-ssm imports); a CPU tensor, or no
    autograd, keeps the reference, whose result then carries gradients as before (the GPU
    comparison of the two: benchmarks/mamba_kernels_gpu_check.py, `check_scan_training`)."""
    x, dt, A, B, C, D, z, bias = _inputs(batch=1, length=9)
    assert ref._mamba_ssm_training(x.requires_grad_(True)) is None  # CPU: the reference
    with torch.no_grad():
        assert ref._mamba_ssm_training(x) is None
    y = ref.mamba_chunk_scan_combined(x, dt, A, B, C, 4, D=D, z=z, dt_bias=bias, dt_softplus=True)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
