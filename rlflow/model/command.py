"""`rlflow init-tiny-model`: write a random Qwen2.5-VL, Qwen3-VL or Nemotron-H checkpoint built in
code (no downloads).

The checkpoint is written into a hidden folder next to DIRECTORY and moved into place when it is
whole: a full disk, a GPU that is not there or Ctrl-C leaves DIRECTORY as it was. An existing
DIRECTORY that holds anything is refused unless --overwrite is given (and then only if it is a
checkpoint: it holds config.json).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import click

from rlflow.errors import Diagnostic, RlflowError
from rlflow.model.presets import PRESET_NAMES

_DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")


@click.command(
    epilog="""\b
Examples:
  rlflow init-tiny-model /tmp/tiny-vlm
  rlflow init-tiny-model /scratch/qwen25vl-3b-random --preset qwen25vl-3b --device cuda
  rlflow init-tiny-model /scratch/qwen3vl-4b-random --preset qwen3vl-4b --device cuda
  rlflow init-tiny-model /scratch/nemotron-h-random --preset nemotron-h-30b-a3b-8l --device cuda
"""
)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--preset",
    type=click.Choice(PRESET_NAMES),
    default="tiny",
    show_default=True,
    help="tiny: ~1 M parameters for CPU tests (Qwen2.5-VL); qwen25vl-3b: Qwen2.5-VL-3B's real "
    "shapes; qwen3vl-4b: Qwen3-VL-4B's real shapes (DeepStack, interleaved mrope); "
    "tiny-nemotron-h: a tiny Nemotron-H hybrid (Mamba-2, attention, MLP; -moe: with MoE "
    "layers); nemotron-h-30b-a3b: Nemotron-H 30B-A3B's shapes (MoE layers), -8l: its first 8 "
    "layers, -dense: the same with MLPs.",
)
@click.option(
    "--seed",
    type=click.IntRange(-(2**63), 2**63 - 1),  # 64 bits, as model.tiny_seed (and torch)
    default=0,
    show_default=True,
    help="Weight and tokenizer seed.",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Where to initialise the weights: cpu, cuda or cuda:N.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace DIRECTORY if it already holds a checkpoint (its config.json).",
)
def init_tiny_model(directory, preset, seed, device, overwrite):
    """Write a random Qwen2.5-VL (with a qwen3vl preset Qwen3-VL, with a nemotron-h preset
    Nemotron-H, with a nemotron-omni preset Nemotron Omni) checkpoint to DIRECTORY.

    The directory is a complete HF checkpoint (config, safetensors, tokenizer, image and video
    processors, chat template) that rlflow loads exactly like a downloaded one.
    """
    from rlflow.model.presets import (
        NEMOTRON_H_PRESET_NAMES,
        NEMOTRON_OMNI_PRESET_NAMES,
        QWEN3VL_PRESET_NAMES,
    )

    try:
        target = _target(directory, overwrite)
    except OSError as err:  # a name too long, a folder you may not list
        raise _refuse(
            f"{directory} cannot be used: {err.strerror or err}", "name another folder"
        ) from None
    _check_device(device)
    if preset in QWEN3VL_PRESET_NAMES:
        from rlflow.model.families.qwen3vl import QWEN3VL_PRESETS, write_tiny_qwen3vl

        sizes = QWEN3VL_PRESETS[preset]
        write, what = write_tiny_qwen3vl, "Qwen3-VL"
    elif preset in NEMOTRON_H_PRESET_NAMES:
        from rlflow.model.families.nemotron_h import PRESETS as HYBRID
        from rlflow.model.families.nemotron_h import write_tiny_nemotron_h

        sizes = HYBRID[preset]
        write, what = write_tiny_nemotron_h, "Nemotron-H"
    elif preset in NEMOTRON_OMNI_PRESET_NAMES:
        from rlflow.model.families.nemotron_omni import PRESETS as OMNI
        from rlflow.model.families.nemotron_omni import write_tiny_nemotron_omni

        sizes = OMNI[preset]
        write, what = write_tiny_nemotron_omni, "Nemotron Omni"
    else:
        from rlflow.model.tiny import PRESETS, write_tiny_checkpoint

        sizes = PRESETS[preset]
        write, what = write_tiny_checkpoint, "Qwen2.5-VL"
    _check_gpu(device)
    _write_whole(target, lambda out: write(out, seed=seed, sizes=sizes, device=device))
    click.echo(f"wrote {preset} {what} checkpoint to {directory}")


def _refuse(message: str, help: str, file: str | None = None) -> RlflowError:  # noqa: A002
    return RlflowError(Diagnostic("model.init-target", message, file=file, help=help))


def _target(directory: str, overwrite: bool) -> Path:
    """DIRECTORY, checked before anything is built: named, creatable, empty (or --overwrite)."""
    if not directory.strip():
        raise _refuse(
            "DIRECTORY is empty: the checkpoint would be written into the current directory",
            "name a new folder, e.g. `rlflow init-tiny-model ./tiny-vlm`",
        )
    target = Path(directory)
    if target.is_dir():
        held = sorted(p.name for p in target.iterdir())
        if held and not overwrite:
            shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
            raise _refuse(
                f"{directory} is not empty (it holds {shown})",
                "name a new folder, or pass --overwrite to replace the checkpoint there",
                directory,
            )
        if held and "config.json" not in held:
            raise _refuse(
                f"{directory} holds files but no checkpoint (no config.json): --overwrite "
                "replaces only a checkpoint",
                "name a new folder",
                directory,
            )
        return target.resolve()
    if os.path.lexists(target):
        raise _refuse(f"{directory} exists and is not a folder", "name a new folder", directory)
    above = target.absolute().parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise _refuse(
            f"{directory} cannot be created: {above} is a file, not a folder",
            "name a folder that is not under a file",
            str(above),
        )
    if not os.access(above, os.W_OK | os.X_OK):
        raise _refuse(
            f"{directory} cannot be created: {above} is not writable by you",
            "name a folder you can write to",
            str(above),
        )
    return target.absolute()


def _check_device(device: str) -> None:
    if not _DEVICE.fullmatch(device):
        raise RlflowError(
            Diagnostic(
                "model.device",
                f"--device {device!r} is not a device init-tiny-model writes from",
                help="pass cpu, cuda or cuda:N",
            )
        )


def _check_gpu(device: str) -> None:
    """The GPU --device names is there (torch is imported by the writer anyway)."""
    if device == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        have = f"{count} GPU{'s' * (count != 1)}" if count else "no GPU torch can use"
        raise RlflowError(
            Diagnostic(
                "model.device",
                f"--device {device}: this machine has {have}",
                help="run it where the GPU is, or pass --device cpu (a tiny model is made in "
                "seconds on a CPU)",
            )
        )


def _write_whole(target: Path, write) -> None:
    """`write(folder)` into a hidden folder beside `target`, moved into place only when whole."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as err:
        raise _refuse(
            f"cannot create {target}: {err.strerror or err}", "name a folder you can create"
        ) from None
    try:
        write(staging)
        if target.is_dir() and any(target.iterdir()):  # --overwrite: the old one goes last
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)  # over an empty folder, or where there was none
    except Exception as err:
        shutil.rmtree(staging, ignore_errors=True)
        if not _write_error(err):
            raise
        raise RlflowError(
            Diagnostic(
                "model.init-write",
                f"cannot write the checkpoint to {target}: {_write_error(err)}; nothing was "
                "written",
                help="free space there (or raise your file size limit), or name a folder on "
                "another file system",
            )
        ) from None
    except BaseException:  # Ctrl-C: nothing half-written either
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_error(err: Exception) -> str | None:
    """What an OS-level write failure says (safetensors and tokenizers wrap it in their own
    exception types); None for anything else, which is a bug and keeps its traceback."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    text = str(err)
    match = re.search(r"(?:I/O error: )?([^:]*) \(os error \d+\)", text)
    return match[1] if match else None
