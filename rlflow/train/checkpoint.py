"""Checkpoints: save every N steps and before the time limit; resume from the newest.

Layout under RUN_DIR/checkpoints/:

    step_000010/            complete checkpoint of step 10 (atomic: written as .tmp, renamed)
      model_tp0_pp0.pt      model weights of one tensor/pipeline shard (data-parallel rank 0 writes)
      optim_tp0_pp0.pt      optimizer state of that shard
      rng_rank0.pt          every rank's RNG states (python, numpy, torch, cuda)
      trainer.json          step, data position, rlflow version
    reference/              the frozen reference policy (the policy when GRPO started)

A crash while writing leaves only a `.tmp` directory, which resume ignores and the next save
replaces. Only complete `step_*` directories count.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from rlflow import parallel
from rlflow.errors import Diagnostic, RlflowError


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last: int):
        self.root = run_dir / "checkpoints"
        self.keep_last = keep_last

    # --- paths -----------------------------------------------------------------------------------

    @staticmethod
    def _shard() -> str:
        info = parallel.info()
        return f"tp{info.tp_rank}_pp{info.pp_rank}"

    def latest(self) -> Path | None:
        steps = sorted(
            p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
        )
        return steps[-1] if steps else None

    # --- save ------------------------------------------------------------------------------------

    def save(self, step: int, policy_chunks, optimizer, trainer_state: dict) -> Path:
        """Every rank calls this; returns the final directory."""
        info = parallel.info()
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        parallel.barrier()
        if info.dp_rank == 0:
            torch.save([c.state_dict() for c in policy_chunks], tmp / f"model_{self._shard()}.pt")
            torch.save(optimizer.state_dict(), tmp / f"optim_{self._shard()}.pt")
        torch.save(_rng_state(), tmp / f"rng_rank{info.rank}.pt")
        if info.is_main:
            state = {**trainer_state, "step": step, "world_size": info.world_size}
            (tmp / "trainer.json").write_text(json.dumps(state, indent=2))
        parallel.barrier()
        if info.is_main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune()
        parallel.barrier()
        return final

    def save_reference(self, reference_chunks) -> None:
        info = parallel.info()
        folder = self.root / "reference"
        if info.dp_rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / f"model_{self._shard()}.pt"
            torch.save([c.state_dict() for c in reference_chunks], target.with_suffix(".tmp"))
            os.replace(target.with_suffix(".tmp"), target)
        parallel.barrier()

    def _prune(self) -> None:
        steps = sorted(
            p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
        )
        for old in steps[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # --- load ------------------------------------------------------------------------------------

    def load(self, directory: Path, policy_chunks, optimizer) -> dict:
        """Restore weights, optimizer, RNG; return trainer.json's content."""
        info = parallel.info()
        state = json.loads((directory / "trainer.json").read_text())
        if state["world_size"] != info.world_size:
            raise RlflowError(
                Diagnostic(
                    "checkpoint.world-size",
                    f"checkpoint {directory} was written by {state['world_size']} ranks; this run has "
                    f"{info.world_size}",
                    help="resume with the same --nodes/--gpus, or start a new run directory",
                )
            )
        _load_chunks(policy_chunks, directory / f"model_{self._shard()}.pt")
        optimizer.load_state_dict(
            torch.load(
                directory / f"optim_{self._shard()}.pt",
                weights_only=False,
                map_location=info.device,
            )
        )
        _set_rng_state(torch.load(directory / f"rng_rank{info.rank}.pt", weights_only=False))
        return state

    def load_reference(self, reference_chunks) -> bool:
        path = self.root / "reference" / f"model_{self._shard()}.pt"
        if not path.exists():
            return False
        _load_chunks(reference_chunks, path)
        return True


def _load_chunks(chunks, path: Path) -> None:
    states = torch.load(path, weights_only=False, map_location=parallel.info().device)
    for chunk, state in zip(chunks, states, strict=True):
        chunk.load_state_dict(state)


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
