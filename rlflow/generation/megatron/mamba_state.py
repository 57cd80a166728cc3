"""Per-row recurrent state of a hybrid model's Mamba-2 layers, for the generation engine.

An attention layer remembers a row through its KV cache (kv_cache.py); a Mamba-2 layer through
two fixed-size tensors per row: the conv state (the last `d_conv` inputs of its causal conv,
[conv_dim, d_conv]) and the SSM state ([heads, head_dim, d_state], float32). `MambaStates` holds
them for every Mamba layer in slots: a row is given a slot when admitted (zeroed), returns it
when it retires, and a prompt's samples get copies of the prompt's slot after its one shared
prefill (`copy`).

`prefill` runs a layer's mixer over packed prompts (the chunked scan, rows kept apart by
`seq_idx`) and leaves each row's final conv and SSM state in its slot; `decode` runs one token
per row on the slots (the single-step conv and state updates). Both compute what megatron-core's
`MambaMixer` computes, from its own parameters (`MambaWeights.of(mixer)`: views, no copies), with
the kernels of rlflow/compat/mamba_reference.py.

`HybridCache` is the engine's cache for a hybrid model: the paged KV cache of its attention
layers (kv_cache.py) plus the Mamba states, one slot per batch position that holds a row. The
book-keeping follows the KV cache's: a position that takes its first block takes a zeroed slot,
one that gives its blocks back (the row retired or was preempted) gives its slot back, and
retiring rows reorders the position -> slot table only (no state moves). Slot 0 is scratch, like
block 0: positions without a row and the CUDA graphs' warm-up steps read and write it. The
decode step reads the slots through a device tensor (`slot_table`), so one captured graph
serves whatever rows hold the positions. Used by hybrid_decoder.py.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlflow.compat import mamba_reference as ref
from rlflow.generation.megatron.kv_cache import KVCache


@dataclass
class MambaWeights:
    """One Mamba-2 mixer's parameters and sizes (megatron-core's `MambaMixer` layout)."""

    in_proj: torch.Tensor  # [2*d_inner + 2*groups*state + heads, hidden]: z, x, B, C, dt
    conv_weight: torch.Tensor  # [conv_dim, d_conv]
    conv_bias: torch.Tensor  # [conv_dim]
    dt_bias: torch.Tensor  # [heads]
    A_log: torch.Tensor  # [heads]
    D: torch.Tensor  # [heads]
    norm_weight: torch.Tensor  # [d_inner]
    out_proj: torch.Tensor  # [hidden, d_inner]
    heads: int
    head_dim: int
    groups: int
    state: int
    norm_eps: float = 1e-5

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.groups * self.state

    @staticmethod
    def of(mixer) -> MambaWeights:
        """Views of a megatron-core MambaMixer's parameters (one tensor-parallel rank)."""
        return MambaWeights(
            in_proj=mixer.in_proj.weight,
            conv_weight=mixer.conv1d_weight[:, 0],
            conv_bias=mixer.conv1d_bias,
            dt_bias=mixer.dt_bias,
            A_log=mixer.A_log,
            D=mixer.D,
            norm_weight=mixer.norm.weight,
            out_proj=mixer.out_proj.weight,
            heads=mixer.nheads_local_tp,
            head_dim=mixer.headdim,
            groups=mixer.ngroups_local_tp,
            state=mixer.d_state,
            norm_eps=mixer.norm.eps,
        )

    def split(self, projected: torch.Tensor):
        """in_proj's output [..., P] -> z [..., d_inner], xBC [..., conv_dim], dt [..., heads]."""
        return torch.split(projected, [self.d_inner, self.conv_dim, self.heads], dim=-1)

    def finish(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated, grouped RMSNorm of the scan's output, then out_proj: [..., hidden]."""
        normed = ref.rms_norm_gated(
            y, self.norm_weight, z, self.norm_eps, self.d_inner // self.groups, False
        )
        return F.linear(normed, self.out_proj)


class MambaStates:
    """Conv and SSM states of every Mamba layer, one slot per live row."""

    def __init__(self, layers: list[MambaWeights], slots: int, device, dtype: torch.dtype):
        first = layers[0]
        self.layers = len(layers)
        self.conv = torch.zeros(
            self.layers,
            slots,
            first.conv_dim,
            first.conv_weight.shape[-1],
            device=device,
            dtype=dtype,
        )
        shape = (self.layers, slots, first.heads, first.head_dim, first.state)
        self.ssm = torch.zeros(shape, device=device, dtype=torch.float32)
        self._free = list(range(slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A zeroed slot for a new row; RuntimeError when every slot is live."""
        if not self._free:
            raise RuntimeError("every Mamba state slot is held by a live row")
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        """The row retired: its slot is free again."""
        if slot in self._free:
            raise ValueError(f"Mamba state slot {slot} is already free")
        self._free.append(slot)

    @staticmethod
    def bytes_per_slot(layers: list[MambaWeights], dtype: torch.dtype) -> int:
        if not layers:
            return 0
        w = layers[0]
        conv = w.conv_dim * w.conv_weight.shape[-1] * torch.finfo(dtype).bits // 8
        return len(layers) * (conv + w.heads * w.head_dim * w.state * 4)

    def copy(self, source: int, targets: list[int]) -> None:
        """After a shared prompt's prefill: each sample's slot starts from the prompt's state."""
        index = torch.tensor(targets, device=self.conv.device)
        self.conv[:, index] = self.conv[:, source, None].clone()
        self.ssm[:, index] = self.ssm[:, source, None].clone()


def prefill(w: MambaWeights, hidden: torch.Tensor, lengths: list[int], states: MambaStates,
            layer: int, slots: list[int]) -> torch.Tensor:  # fmt: skip
    """Packed prompts hidden [T, hidden] (rows of `lengths`, laid end to end) -> [T, hidden];
    each row's final conv and SSM state written into its slot.

    On CUDA tensors (ref.TRITON_DEVICES) the conv and the scan run every prompt at once on
    megatron-core's Triton varlen kernels (the calls its own mixer makes for a dynamic batch's
    prefills: no state crosses a prompt's end); elsewhere, or with TRITON_PREFILL off, the
    reference's conv over the packed prompts and its scan one prompt at a time."""
    z, xBC, dt = w.split(F.linear(hidden, w.in_proj))
    cu = [0, *itertools.accumulate(lengths)]
    width = w.conv_weight.shape[-1]
    for row, slot in enumerate(slots):  # conv state: the row's last `width` inputs, zero-padded
        window = xBC[max(cu[row], cu[row + 1] - width) : cu[row + 1]].T
        states.conv[layer, slot] = F.pad(window, (width - window.shape[-1], 0))
    A = -torch.exp(w.A_log.float())
    on_triton = TRITON_PREFILL and hidden.device.type in ref.TRITON_DEVICES
    kernels = ref.triton_varlen_kernels() if on_triton else None
    if kernels is not None:
        conv_fn, scan_fn = kernels

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(hidden.device, non_blocking=True)

        x, B, C = _split(w, conv_fn(xBC.contiguous(), w.conv_weight, w.conv_bias, index(cu)))
        rows = torch.tensor(slots, device=hidden.device)
        y = torch.zeros_like(x)
        final = scan_fn(
            x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(), SCAN_CHUNK,
            *map(index, ref.varlen_chunks(cu, SCAN_CHUNK)), y, D=w.D,
            dt_bias=w.dt_bias.float(), initial_states=states.ssm[layer, rows], dt_softplus=True,
            state_dtype=torch.float32,
        )  # fmt: skip
        states.ssm[layer, rows] = final
        return w.finish(y.reshape(-1, w.d_inner), z)
    seq_idx = ref.seq_idx_of(torch.tensor(cu, device=hidden.device), hidden.shape[0])
    conv = ref.causal_conv1d_fn(
        xBC.T[None], w.conv_weight, w.conv_bias, seq_idx=seq_idx, activation="silu"
    )[0].T
    x, B, C = _split(w, conv)
    ys = []
    for row, slot in enumerate(slots):  # one scan per prompt: its final state is its slot's
        rows = slice(cu[row], cu[row + 1])
        y, final = ref.mamba_chunk_scan_combined(
            x[None, rows], dt[rows][None], A, B[None, rows], C[None, rows], chunk_size=SCAN_CHUNK,
            D=w.D, dt_bias=w.dt_bias, dt_softplus=True,
            initial_states=states.ssm[layer, slot][None], return_final_states=True,
        )  # fmt: skip
        states.ssm[layer, slot] = final[0]
        ys.append(y.reshape(rows.stop - rows.start, w.d_inner))
    return w.finish(torch.cat(ys), z)


def decode(w: MambaWeights, hidden: torch.Tensor, states: MambaStates, layer: int,
           slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token per row hidden [R, hidden] -> [R, hidden]; the rows' slots advance one step.

    On CUDA tensors (ref.TRITON_DEVICES) both steps are megatron-core's Triton ops, in place on
    the slots (`causal_conv1d_update` with `conv_state_indices`, `selective_state_update` with
    `state_batch_indices`: no gather or scatter of the states); elsewhere, or with
    TRITON_DECODE off, the reference's, on the gathered states."""
    z, xBC, dt = w.split(F.linear(hidden, w.in_proj))
    A = -torch.exp(w.A_log.float())
    if TRITON_DECODE and hidden.device.type in ref.TRITON_DEVICES and _triton_ops() is not None:
        conv_update, ssm_update = _triton_ops()
        conv = conv_update(  # "silu" as a string: the op compares it with == "silu"
            xBC, states.conv[layer], w.conv_weight, w.conv_bias, "silu", slots
        )
        x, B, C = _split(w, conv)
        y = ssm_update(
            states.ssm[layer], x, dt[..., None].expand(-1, -1, w.head_dim),
            A.view(-1, 1, 1).expand(-1, w.head_dim, w.state), B, C,
            w.D[:, None].expand(-1, w.head_dim), dt_bias=w.dt_bias[:, None].expand(-1, w.head_dim),
            dt_softplus=True, state_batch_indices=slots,
        )  # fmt: skip
        return w.finish(y.reshape(-1, w.d_inner), z)
    conv_state = states.conv[layer, slots]
    conv = ref.causal_conv1d_update(xBC, conv_state, w.conv_weight, w.conv_bias, activation="silu")
    states.conv[layer, slots] = conv_state
    x, B, C = _split(w, conv)
    ssm = states.ssm[layer, slots]
    y = ref.selective_state_update(ssm, x, dt, A, B, C, D=w.D, dt_bias=w.dt_bias, dt_softplus=True)
    states.ssm[layer, slots] = ssm
    return w.finish(y.reshape(-1, w.d_inner), z)


def _split(w: MambaWeights, conv: torch.Tensor):
    """The conv's output [R, conv_dim] -> x [R, H, P], B and C [R, G, N]."""
    x, B, C = torch.split(conv, [w.d_inner, w.groups * w.state, w.groups * w.state], dim=-1)
    rows = conv.shape[0]
    return (x.reshape(rows, w.heads, w.head_dim), B.reshape(rows, w.groups, w.state),
            C.reshape(rows, w.groups, w.state))  # fmt: skip


TRITON_DECODE = True  # benchmarks/hybrid_engine_gpu_check.py turns it off to compare
TRITON_PREFILL = True  # likewise
SCAN_CHUNK = 128  # the prefill scan's chunk (tokens), megatron-core's default for Nemotron-H


@functools.cache
def _triton_ops():
    """megatron-core's Triton (causal_conv1d_update, selective_state_update), or None (no
    Triton: CPU installs)."""
    try:
        from megatron.core.ssm.ops.causal_conv1d_triton import causal_conv1d_update
        from megatron.core.ssm.ops.mamba_ssm import selective_state_update
    except ImportError:
        return None
    return causal_conv1d_update, selective_state_update


class HybridCache(KVCache):
    """The KV cache of the attention layers plus one Mamba state slot per batch position that
    holds a row (`states`; slot 0 is scratch). Batch positions are those of KVCache."""

    def __init__(self, mamba: list[MambaWeights], num_layers: int, *, rows: int, **kv):
        super().__init__(num_layers, rows=rows, **kv)
        self.states = MambaStates(mamba, rows + 1, kv["device"], kv["dtype"])
        assert self.states.allocate() == 0  # scratch
        self._slot = [0] * rows  # the slot of each batch position (0: none, scratch)
        self.slot_table = torch.zeros(rows, dtype=torch.long, device=kv["device"])
        self._sources: list[int] = []  # each unique prompt's slot, for the next prefill
        self._copies: tuple[list[int], list[int]] = ([], [])

    def grow(self, tokens: list[int]) -> None:
        """KVCache.grow; a position that holds tokens and no slot yet gets a zeroed one."""
        super().grow(tokens)
        for p, t in enumerate(tokens):
            if t and not self._slot[p]:
                self._slot[p] = self.states.allocate()

    def release(self, positions) -> None:
        super().release(positions)
        for p in positions:
            if self._slot[p]:
                self.states.release(self._slot[p])
                self._slot[p] = 0

    def release_all(self) -> None:
        super().release_all()
        self.release([p for p in range(self.rows) if self._slot[p]])

    def compact(self, order: list[int]) -> None:
        super().compact(order)
        self._slot = [self._slot[p] for p in order] + [0] * (self.rows - len(order))

    def upload(self) -> None:
        super().upload()
        source = torch.tensor(self._slot, dtype=torch.long)
        self.slot_table.copy_(source.pin_memory() if self.slot_table.is_cuda else source)

    def share(self, row_prompt: list[int], base: int = 0) -> None:
        """Before a prefill: batch position base + i holds a sample of unique prompt
        row_prompt[i] (prompts numbered in packing order). The prefill writes each prompt's
        final states into its first sample's slot (`prompt_slots`); `copy_samples` then copies
        that snapshot to the slots of its other samples."""
        first: dict[int, int] = {}
        targets, sources = [], []
        for i, prompt in enumerate(row_prompt):
            slot = self._slot[base + i]
            if prompt in first:
                targets.append(slot)
                sources.append(first[prompt])
            else:
                first[prompt] = slot
        self._sources = [first[p] for p in sorted(first)]
        self._copies = (sources, targets)

    @property
    def prompt_slots(self) -> list[int]:
        return self._sources

    def copy_samples(self) -> None:
        """After the shared prefill: every other sample's slot <- its prompt's snapshot."""
        sources, targets = self._copies
        if targets:
            device = self.states.conv.device
            src, dst = (torch.tensor(t, device=device) for t in (sources, targets))
            self.states.conv.index_copy_(1, dst, self.states.conv.index_select(1, src))
            self.states.ssm.index_copy_(1, dst, self.states.ssm.index_select(1, src))
