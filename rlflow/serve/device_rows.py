"""The serving batch's per-row state on the device: decode steps run with no host sync.

rlflow/serve/batch.py runs its rows in intervals of `CHECK_EVERY` decode steps, as `generate()`
checks its rows every few steps (rlflow/generation/megatron/engine.py). Between two checks the
host never waits for the device: each step samples one token per row (the row's own sampling
parameters, seed and step), records it, marks the rows that stopped (a stop token of the row's
request, its max_tokens, the context) and feeds the tokens to the next decode step. A stopped
row stops growing: it rewrites its last cache slot until the check retires it, so it needs no
block past the ones it has. At the check the host reads the interval's tokens at once.

Stop tokens are a lookup table [stop sets, vocab] (a row reads the row of its request's set):
requests of one client share one set, so the table stays a few rows.
"""

from __future__ import annotations

import torch

from rlflow.generation.megatron.sampling import sample_tokens

CHECK_EVERY = 8  # decode steps between two host checks (admission, retirement, cancellation)
_MAX_STOP_SETS = 256  # distinct stop sets kept on the device before the table is rebuilt

# per-row state: (dtype, the value of a batch position no row holds)
_STATE = {
    "seeds": (torch.long, 0),
    "generated": (torch.long, 0),  # tokens the row has drawn (its sampling step)
    "count": (torch.long, 0),  # tokens drawn in this interval
    "last": (torch.long, 0),  # the token the next decode step feeds
    "positions": (torch.long, 0),  # its text position
    "lengths": (torch.long, 1),  # keys the row attends to, including the fed token
    "limit": (torch.long, 0),  # min(max_tokens, context - prompt)
    "stop_set": (torch.long, 0),
    "finished": (torch.bool, True),
}


class DeviceRows:
    """State of batch positions 0..capacity-1 (rows at 0..n-1, the rest padding)."""

    def __init__(self, capacity: int, device):
        self.device = device
        self.n = 0
        self.state = {
            name: torch.full((capacity,), pad, dtype=dtype, device=device)
            for name, (dtype, pad) in _STATE.items()
        }
        self.tokens = torch.zeros(capacity, CHECK_EVERY, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(capacity, CHECK_EVERY, dtype=torch.float32, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # this interval's next
        self._stop_index: dict[tuple, int] = {}  # a stop set -> its row of the table
        self._stop_table: torch.Tensor | None = None  # [sets, vocab] bool
        self._table_version = 0  # + 1 whenever the table is a new tensor (graphs read it)
        self._keys: list[tuple] = []  # each position's stop set
        self._groups: list[tuple[object, torch.Tensor | None]] = []  # (params, positions)
        self._params: list = []  # each position's sampling parameters

    def padded(self, name: str, size: int) -> torch.Tensor:
        """positions 0..size-1 of a state tensor (the decode step's batch bucket)."""
        return self.state[name][:size]

    def place(self, rows, positions: torch.Tensor, vocab: int, context_tokens: int) -> None:
        """New rows at positions n..n+len(rows)-1: positions [rows] are their first generated
        token's text positions (on the device, from the prefill)."""
        first, count = self.n, len(rows)
        by_request: dict[int, tuple] = {}  # (a request's rows share its set)
        keys = [by_request.setdefault(id(r.request), _stop_key(r.request.params)) for r in rows]
        self._stop_rows(keys, vocab)
        host = torch.tensor(
            [
                [r.seed, r.prompt_len, _limit(r, context_tokens), self._stop_index[k]]
                for r, k in zip(rows, keys)
            ],
            dtype=torch.long,
        )
        host = host.pin_memory() if self.device.type == "cuda" else host
        values = host.to(self.device, non_blocking=True)
        end = first + count
        s = self.state
        s["seeds"][first:end] = values[:, 0]
        s["lengths"][first:end] = values[:, 1]
        s["limit"][first:end] = values[:, 2]
        s["stop_set"][first:end] = values[:, 3]
        s["positions"][first:end] = positions - 1
        for name in ("generated", "count", "last"):
            s[name][first:end] = 0
        s["finished"][first:end] = False
        self.n = end
        self._keys += keys
        self._params += [r.request.params for r in rows]
        self._regroup()

    def reorder(self, keep: list[int]) -> None:
        """Positions keep[0..] move to the front; the rest become padding."""
        index = torch.tensor(keep, dtype=torch.long)
        if self.device.type == "cuda":
            index = index.pin_memory()
        index = index.to(self.device, non_blocking=True)
        n = len(keep)
        for name, (_, pad) in _STATE.items():
            tensor = self.state[name]
            kept = tensor.index_select(0, index)
            tensor[:n] = kept
            tensor[n : self.n] = pad
        self.n = n
        self._keys = [self._keys[p] for p in keep]
        self._params = [self._params[p] for p in keep]
        self._regroup()

    def step(self, logits: torch.Tensor, rows: int | None = None) -> None:
        """Sample a token for positions 0..rows-1 (default: the rows) from logits [rows, V],
        record it in this interval's next column and advance the rows that had not stopped
        (all on the device; padding positions are stopped: nothing of theirs changes)."""
        rows = self.n if rows is None else rows
        s = {name: tensor[:rows] for name, tensor in self.state.items()}
        seeds, generated = s["seeds"], s["generated"]
        if len(self._groups) == 1:
            token, logprob = sample_tokens(logits, self._groups[0][0], seeds, generated)
        else:
            token = torch.empty(rows, dtype=torch.long, device=self.device)
            logprob = torch.empty(rows, dtype=logits.dtype, device=self.device)
            for params, index in self._groups:
                t, lp = sample_tokens(logits[index], params, seeds[index], generated[index])
                token[index], logprob[index] = t, lp
        live = ~s["finished"]
        self.tokens[:rows].index_copy_(1, self.column, token[:, None])
        self.logprobs[:rows].index_copy_(1, self.column, logprob[:, None].float())
        self.column.add_(1)
        generated.add_(live)
        s["count"].add_(live)
        stop = self._stop_table[s["stop_set"], token] | (generated >= s["limit"])
        s["finished"].logical_or_(stop)
        s["last"].copy_(torch.where(live, token, s["last"]))
        s["lengths"].add_(live)
        s["positions"].add_(live)

    def graph_key(self) -> tuple | None:
        """What a captured step depends on besides the state tensors: the sampling parameters
        of the rows' one group and the stop table; None when the rows sample in groups."""
        if len(self._groups) != 1:
            return None
        p = self._groups[0][0]
        return (p.temperature, p.top_p, p.top_k, self._table_version)

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of every device tensor a step changes (a graph's warm-up restores them)."""
        tensors = [*self.state.values(), self.tokens, self.logprobs, self.column]
        return [(t, t.clone()) for t in tensors]

    def read(self, steps: int) -> tuple[list[int], list[bool], list[list[int]], list[list]]:
        """The interval's (tokens per row, stopped, tokens, logprobs): the host's one sync."""
        n = self.n
        count, finished = self.state["count"][:n], self.state["finished"][:n]
        head = torch.cat([count[:, None], finished[:, None].long(), self.tokens[:n, :steps]], 1)
        head = head.cpu()
        logprobs = self.logprobs[:n, :steps].cpu().tolist()
        count.zero_()
        self.column.zero_()
        head = head.tolist()
        return [h[0] for h in head], [bool(h[1]) for h in head], [h[2:] for h in head], logprobs

    def _regroup(self) -> None:
        """Rows grouped by (temperature, top_p, top_k): one sampling call per group."""
        groups: dict[tuple, list[int]] = {}
        for p, params in enumerate(self._params):
            groups.setdefault((params.temperature, params.top_p, params.top_k), []).append(p)
        self._groups = []
        for members in groups.values():
            index = None
            if len(groups) > 1:
                index = torch.tensor(members, dtype=torch.long).to(self.device)
            self._groups.append((self._params[members[0]], index))

    def _stop_rows(self, keys: list[tuple], vocab: int) -> None:
        """Rows of the stop table for every set in `keys`; when it would hold too many, it
        starts over from the sets of the rows in the batch."""
        new = [k for k in dict.fromkeys(keys) if k not in self._stop_index]
        if not new:
            return
        if len(self._stop_index) + len(new) <= _MAX_STOP_SETS:
            self._add_stop_sets(new, vocab)
            return
        in_use = list(dict.fromkeys(self._keys))
        self._stop_index, self._stop_table = {}, None
        self._add_stop_sets(in_use + [k for k in new if k not in set(in_use)], vocab)
        index = torch.tensor([self._stop_index[k] for k in self._keys], dtype=torch.long)
        self.state["stop_set"][: self.n] = index.to(self.device)

    def _add_stop_sets(self, keys: list[tuple], vocab: int) -> None:
        table = torch.zeros(len(keys), vocab, dtype=torch.bool)
        for i, key in enumerate(keys):
            table[i, torch.tensor([t for t in key if 0 <= t < vocab], dtype=torch.long)] = True
            self._stop_index[key] = len(self._stop_index)
        table = table.to(self.device)
        old = self._stop_table
        self._stop_table = table if old is None else torch.cat([old, table])
        self._table_version += 1


def _stop_key(params) -> tuple:
    """The tokens that stop a row of these parameters (none with ignore_eos)."""
    return () if params.ignore_eos else tuple(params.stop_token_ids)


def _limit(row, context_tokens: int) -> int:
    return min(row.request.params.max_new_tokens, context_tokens - row.prompt_len)


class StepGraph:
    """One CUDA graph of a whole decode step for batch bucket `size`: decode the rows' last
    tokens, sample from the logits, record and advance (DeviceRows.step). Its inputs and
    outputs are the DeviceRows tensors themselves, so the engine's thread launches a step with
    one call (it shares its process with the HTTP threads: fewer calls, fewer waits for the
    GIL)."""

    def __init__(self, rows: DeviceRows, decode, size: int, pool):
        def run():
            logits = decode(
                rows.padded("last", size), rows.padded("positions", size),
                rows.padded("lengths", size),
            )  # fmt: skip
            rows.step(logits, size)

        device = rows.device
        saved = rows.snapshot()  # warm-up runs really execute: the state is put back after
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # (their cache writes are the ones the first replay repeats)
                run()
                for tensor, copy in saved:
                    tensor.copy_(copy)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            run()

    def replay(self) -> None:
        self.graph.replay()
