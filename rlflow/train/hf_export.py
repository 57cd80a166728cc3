"""The policy as an HF checkpoint during training: `checkpointing.hf_export_period`.

Every N steps (and at the last step) the run writes RUN_DIR/hf/step_N/, a directory that
`transformers` loads and generates from (`AutoModelForImageTextToText.from_pretrained(dir)`, or
the family's class): the source checkpoint's config, generation config, tokenizer, chat template
and processor files, and the policy's current weights as safetensors shards under the on-disk
HF names (megatron-bridge's export: the same names, shapes and dtypes the source checkpoint has).

Rules:
- Every rank takes part (the export gathers tensor-, pipeline- and expert-parallel shards, as
  `model.build.export_hf_state_dict` does); global rank 0 alone writes, one shard at a time, so
  memory holds one shard, never the whole model.
- Atomic: the directory is written as step_N.tmp and renamed once complete; a crash leaves only
  a .tmp directory, which the next export replaces.
- `hf_export_keep_last` keeps the newest k exports.
- The files are what the bridge and the checkpoint say; nothing here knows a family.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from rlflow import parallel
from rlflow.train import watchdog

_STEP_DIR = re.compile(r"step_(\d+)")
SHARD_BYTES = 4 * 2**30  # per safetensors file, as HF shards a large checkpoint
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt)$|.*\.safetensors\.index\.json$")


def after_step(t, step: int, last: bool) -> None:
    """The train loop's one call: export if `checkpointing.hf_export_period` says this step."""
    cfg = t.recipe.checkpointing
    if due(step, last, cfg.hf_export_period):
        watchdog.beat("checkpoint_save")
        path = export_step(t.policy, t.run_dir, step, cfg.hf_export_keep_last)
        t.log.write(f"step {step}: HF checkpoint written to {path}")


def due(step: int, last: bool, period: int) -> bool:
    """Whether step `step` exports: every `period` steps and the last step; never at period 0."""
    return period > 0 and (step % period == 0 or last)


def export_step(policy, run_dir: Path, step: int, keep_last: int) -> Path:
    """Write RUN_DIR/hf/step_N (every rank calls; rank 0 writes); returns its path."""
    root = Path(run_dir) / "hf"
    final = root / f"step_{step:06d}"
    export(policy, final)
    if parallel.info().is_main:
        _prune(root, keep_last)
    return final


def export(policy, out: Path) -> None:
    """The policy as an HF checkpoint directory at `out` (replaced if it exists)."""
    main = parallel.info().is_main
    tmp = out.with_name(out.name + ".tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _copy_non_weights(Path(policy.checkpoint), tmp)
    tensors = policy.bridge.export_hf_weights(policy.chunks, cpu=True, show_progress=False)
    writer = _ShardWriter(tmp) if main else None
    for name, tensor in tensors:
        if writer is not None:
            writer.add(name, tensor)
    if writer is not None:
        writer.close()
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    if dist.is_initialized():
        dist.barrier()


def _copy_non_weights(source: Path, dest: Path) -> None:
    """config, generation config, tokenizer, chat template, processor files: all but weights."""
    for path in source.iterdir():
        if path.is_file() and not _WEIGHT_FILES.fullmatch(path.name):
            shutil.copy2(path, dest / path.name)


class _ShardWriter:
    """Safetensors shards of at most SHARD_BYTES, then HF's index (model.safetensors.index.json)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > SHARD_BYTES:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.folder / f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        watchdog.beat()  # progress: a large model's export takes many shards
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.folder / "model.safetensors")
            return
        count, weight_map = len(self.files), {}
        for i, (path, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map |= dict.fromkeys(names, final)
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _prune(root: Path, keep_last: int) -> None:
    exports = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()
    )
    for _, path in exports[: max(len(exports) - keep_last, 0)]:
        shutil.rmtree(path, ignore_errors=True)
