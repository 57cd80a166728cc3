"""Checkpoints: save every N steps and before the time limit; resume from the newest that verifies.

Layout under RUN_DIR/checkpoints/:

    step_000010/            complete checkpoint of step 10 (written as .tmp, renamed)
      model_tp0_pp0.pt      model weights of one tensor/pipeline shard (data-parallel rank 0 writes)
      optim_tp0_pp0.pt      optimizer state of that shard
      rng_rank0.pt          every rank's RNG states (python, numpy, torch, cuda)
      trainer.json          step, data position, world size
      rollouts_rank0.json   every rank's rows in flight (partial rollouts only: train/partial.py)
      manifest.json         every file's size and blake2b checksum, written last (manifest.py)
    step_000020.damaged/    a checkpoint that failed verification, set aside for inspection
    reference/              the frozen reference policy (the policy when GRPO started), + manifest

Rules:
- A crash while writing leaves only a `.tmp` directory, which resume ignores and the next save
  replaces. Only `step_N` directories with a manifest count.
- Resume uses the newest checkpoint whose manifest verifies on every rank (sizes of all files,
  checksums of the files each rank loads). A damaged one is reported, naming the file and what
  is wrong, renamed to `step_N.damaged`, and the next older one is tried. If checkpoints exist
  but none verifies, the run stops (exit 2) rather than silently start over.
- Before a save, free space must cover the previous checkpoint's size; a save that runs out of
  space says so and leaves the previous checkpoint as it was.
- `keep_last` prunes older checkpoints, but never the newest one that verifies.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from rlflow import bounded, parallel
from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe.schema import CheckpointConfig
from rlflow.train import manifest, storage
from rlflow.train.faults import inject_failure

_STEP_DIR = re.compile(r"step_(\d+)")
TRAINER_STATE = "trainer.json"


def due(cfg: CheckpointConfig, step: int, *, last: bool, stop: bool) -> bool:
    """Whether step `step` ends with a checkpoint (checkpointing.enabled): every save_period
    steps, the last step, and the step a stop request ends."""
    return cfg.enabled and (step % cfg.save_period == 0 or last or stop)


# A rank's rows in flight: ~30 bytes a token; 512 rows of 4096 tokens are ~60 MB.
_ROLLOUTS_MAX_BYTES = 1 << 30


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last: int):
        self.root = run_dir / "checkpoints"
        self.keep_last = keep_last

    # --- paths -----------------------------------------------------------------------------------

    @staticmethod
    def _shard() -> str:
        info = parallel.info()
        return f"tp{info.tp_rank}_pp{info.pp_rank}"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest first (not .tmp, not .damaged)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
        return sorted(found, key=lambda p: int(_STEP_DIR.fullmatch(p.name)[1]))

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies on every rank (a collective: call on all ranks).

        Damaged ones on the way are reported and set aside as `step_N.damaged`."""
        info = parallel.info()
        candidates = self.checkpoints()
        damaged = []
        for directory in reversed(candidates):
            problems = self._verify_for_this_rank(directory)
            if not parallel.all_reduce_max(1.0 if problems else 0.0):
                return directory
            if problems:
                warning = _damaged(directory, problems, "trying the previous checkpoint")
                print(warning.render() + "\n", file=sys.stderr, flush=True)
            damaged.append(directory)
            parallel.barrier()
            if info.is_main:
                _set_aside(directory)
            parallel.barrier()
        set_aside = sorted(p.name for p in self.root.glob("step_*.damaged*"))
        if damaged or set_aside:
            # Starting over silently would discard the run's progress: the user decides.
            raise RlflowError(
                Diagnostic(
                    "checkpoint.none-verified",
                    f"no checkpoint in {self.root} verifies; damaged ones are kept as: "
                    + ", ".join(set_aside),
                    help="the warnings above (or an earlier attempt's log) say what is wrong; "
                    "to start this run over, move the *.damaged folders away, or start a new "
                    "run directory",
                )
            )
        return None

    def _verify_for_this_rank(self, directory: Path) -> list[str]:
        """Sizes of every file; checksums of the files this rank loads. The main rank also
        checks that the files every rank needs are listed."""
        info = parallel.info()
        mine = {f"model_{self._shard()}.pt", f"optim_{self._shard()}.pt", f"rng_rank{info.rank}.pt"}
        expected = set(mine)
        if info.is_main:
            mine.add(TRAINER_STATE)
            expected = {TRAINER_STATE, *(f"rng_rank{r}.pt" for r in range(info.world_size))}
            expected |= mine
        return manifest.verify(directory, deep=mine, expected=expected)

    # --- save ------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        policy_chunks,
        optimizer,
        trainer_state: dict,
        rank_state: dict | None = None,
    ) -> Path:
        """Every rank calls this; returns the final directory. rank_state: this rank's rollouts
        in flight (JSON), or None."""
        info = parallel.info()
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        needed = self._previous_size()
        if info.is_main:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as err:
                raise _write_failed(tmp, err) from None
            had = storage.free_bytes(tmp)
            if needed is not None and had < needed:
                shutil.rmtree(tmp, ignore_errors=True)
                raise storage.no_space(
                    tmp, needed, had, f"checked before saving step {step} in {self.root}"
                )
        parallel.barrier()
        had = storage.free_bytes(tmp)
        written = []
        try:
            if info.dp_rank == 0:
                torch.save(
                    [c.state_dict() for c in policy_chunks], tmp / f"model_{self._shard()}.pt"
                )
                written.append(f"model_{self._shard()}.pt")
                torch.save(optimizer.state_dict(), tmp / f"optim_{self._shard()}.pt")
                written.append(f"optim_{self._shard()}.pt")
            torch.save(_rng_state(), tmp / f"rng_rank{info.rank}.pt")
            written.append(f"rng_rank{info.rank}.pt")
            if rank_state is not None:
                (tmp / f"rollouts_rank{info.rank}.json").write_text(json.dumps(rank_state))
                written.append(f"rollouts_rank{info.rank}.json")
            if info.is_main:
                state = {**trainer_state, "step": step, "world_size": info.world_size}
                (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2))
                written.append(TRAINER_STATE)
            manifest.write_part(tmp, info.rank, written)
        except (OSError, RuntimeError) as err:
            estimate = needed or _state_bytes(policy_chunks, optimizer) * info.world_size
            if storage.is_no_space(err, tmp, estimate):
                shutil.rmtree(tmp, ignore_errors=True)
                raise storage.no_space(
                    tmp,
                    estimate,
                    had,
                    f"saving step {step} failed ({type(err).__name__}: {_first_line(err)}); "
                    f"the unfinished {tmp.name} was removed",
                ) from None
            raise _write_failed(tmp, err) from None
        parallel.barrier()
        inject_failure(info.job_rank, f"saving{step}")  # every file written, none in place
        if info.is_main:
            try:
                manifest.write_manifest(tmp, step)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                _fsync_dir(self.root)
            except OSError as err:
                raise _write_failed(tmp, err) from None
            self._prune()
        parallel.barrier()
        return final

    def _previous_size(self) -> int | None:
        for directory in reversed(self.checkpoints()):
            size = manifest.total_size(directory)
            if size is not None:
                return size
        return None

    def save_reference(self, reference_chunks) -> None:
        info = parallel.info()
        folder = self.root / "reference"
        name = f"model_{self._shard()}.pt"
        try:
            if info.is_main:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / manifest.MANIFEST).unlink(missing_ok=True)
            parallel.barrier()
            if info.dp_rank == 0:
                target = folder / name
                torch.save([c.state_dict() for c in reference_chunks], target.with_suffix(".tmp"))
                os.replace(target.with_suffix(".tmp"), target)
                manifest.write_part(folder, info.rank, [name])
            parallel.barrier()
            if info.is_main:
                manifest.write_manifest(folder, None)
        except (OSError, RuntimeError) as err:
            if storage.is_no_space(err, folder, 0):
                raise storage.no_space(
                    folder,
                    _state_bytes(reference_chunks, None),
                    storage.free_bytes(folder),
                    "saving the reference policy failed",
                ) from None
            raise _write_failed(folder, err) from None
        parallel.barrier()

    def _prune(self) -> None:
        """Keep the newest `keep_last`, and always the newest checkpoint that verifies."""
        steps = self.checkpoints()
        keep = set(steps[-self.keep_last :])
        newest_good = next((d for d in reversed(steps) if not manifest.verify(d, deep=set())), None)
        if newest_good is not None:
            keep.add(newest_good)
        for old in steps:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)

    # --- load ------------------------------------------------------------------------------------

    def load(self, directory: Path, policy_chunks, optimizer) -> dict:
        """Restore weights, optimizer, RNG; return trainer.json's content."""
        info = parallel.info()
        path = directory / TRAINER_STATE
        try:
            state = manifest.read_json(path)  # bounded: never a FIFO, /dev/zero or 50 GB
            written_by = int(state["world_size"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise _load_failed(path, err) from None
        if written_by != info.world_size:
            raise RlflowError(
                Diagnostic(
                    "checkpoint.world-size",
                    f"checkpoint {directory} was written by {written_by} ranks; this run has "
                    f"{info.world_size}",
                    help="resume with the same --nodes/--gpus, or start a new run directory",
                )
            )
        _load_chunks(policy_chunks, directory / f"model_{self._shard()}.pt")
        path = directory / f"optim_{self._shard()}.pt"
        try:
            optimizer.load_state_dict(
                torch.load(path, weights_only=False, map_location=info.device)
            )
            path = directory / f"rng_rank{info.rank}.pt"
            _set_rng_state(torch.load(path, weights_only=False))
        except Exception as err:  # noqa: BLE001 - any failure to read a file is "this file"
            raise _load_failed(path, err) from None
        return state

    def rank_state(self, directory: Path) -> dict | None:
        """This rank's rollouts in flight saved with the checkpoint, or None (none saved)."""
        path = directory / f"rollouts_rank{parallel.info().rank}.json"
        if not path.exists():
            return None
        try:
            return json.loads(bounded.read_bytes(path, _ROLLOUTS_MAX_BYTES, manifest.READ_SECONDS))
        except (OSError, ValueError) as err:
            raise _load_failed(path, err) from None

    def load_reference(self, reference_chunks) -> bool:
        """Restore the reference policy saved when GRPO started (on resume)."""
        folder = self.root / "reference"
        name = f"model_{self._shard()}.pt"
        problems = manifest.verify(folder, deep={name}, expected={name})
        if problems:
            raise RlflowError(
                _damaged(
                    folder,
                    problems,
                    "the reference policy (the KL anchor) cannot be rebuilt from a later "
                    "checkpoint",
                    severity="error",
                    help="start a new run directory (or set loss.kl_penalty: 0 to train "
                    "without the reference)",
                )
            )
        _load_chunks(reference_chunks, folder / name)
        return True


def _damaged(
    directory: Path, problems: list[str], consequence: str, severity="warning", help=None
) -> Diagnostic:
    return Diagnostic(
        "checkpoint.damaged",
        f"checkpoint {directory} is damaged: {problems[0]}",
        severity=severity,
        notes=tuple(problems[1:]) + (consequence,),
        help=help
        or f"it is kept as {directory.name}.damaged for inspection; nothing was loaded from it",
    )


def _set_aside(directory: Path) -> Path:
    target = directory.with_name(directory.name + ".damaged")
    n = 1
    while target.exists():
        n += 1
        target = directory.with_name(f"{directory.name}.damaged{n}")
    os.replace(directory, target)
    return target


def _write_failed(path: Path, err: BaseException) -> RlflowError:
    return RlflowError(
        Diagnostic(
            "rundir.write-failed",
            f"cannot write checkpoint {path}: {_first_line(err)}",
            help="check that the run directory is writable and its disk is healthy; the "
            "previous checkpoint is intact",
        )
    )


def _load_failed(path: Path, err: BaseException) -> RlflowError:
    if isinstance(err, bounded.UnreadableFile):  # replaced after it verified: say what it is
        return RlflowError(
            Diagnostic(
                "checkpoint.load",
                f"cannot load {path}: {err}",
                help="a checkpoint's files are regular files rlflow wrote: restore this one, "
                "or move the checkpoint folder away to resume from an older one",
            )
        )
    return RlflowError(
        Diagnostic(
            "checkpoint.load",
            f"cannot load {path}: {type(err).__name__}: {_first_line(err)}",
            help="the file verified against its manifest, so it was written like this: was the "
            "recipe's model or parallelism changed since? resume with the same recipe, or start "
            "a new run directory",
        )
    )


def _first_line(err: BaseException) -> str:
    text = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state_bytes(chunks, optimizer) -> int:
    """Approximate bytes of a save: parameters (+ optimizer state, when given)."""
    try:
        states = [c.state_dict() for c in chunks]
        if optimizer is not None:
            states.append(optimizer.state_dict())
        return _tensor_bytes(states)
    except Exception:  # noqa: BLE001 - only an estimate for an error message
        return 0


def _tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _load_chunks(chunks, path: Path) -> None:
    try:
        states = torch.load(path, weights_only=False, map_location=parallel.info().device)
        for chunk, state in zip(chunks, states, strict=True):
            chunk.load_state_dict(state)
    except Exception as err:  # noqa: BLE001 - any failure to read a file is "this file"
        raise _load_failed(path, err) from None


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
