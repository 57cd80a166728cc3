"""`rlflow init-tiny-model`: write a random Qwen2.5-VL or Qwen3-VL checkpoint built in code (no
downloads)."""

from __future__ import annotations

import click

from rlflow.model.presets import PRESET_NAMES


@click.command(
    epilog="""\b
Examples:
  rlflow init-tiny-model /tmp/tiny-vlm
  rlflow init-tiny-model /scratch/qwen25vl-3b-random --preset qwen25vl-3b --device cuda
  rlflow init-tiny-model /scratch/qwen3vl-4b-random --preset qwen3vl-4b --device cuda
"""
)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--preset",
    type=click.Choice(PRESET_NAMES),
    default="tiny",
    show_default=True,
    help="tiny: ~1 M parameters for CPU tests (Qwen2.5-VL); qwen25vl-3b: Qwen2.5-VL-3B's real "
    "shapes; qwen3vl-4b: Qwen3-VL-4B's real shapes (DeepStack, interleaved mrope).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Weight and tokenizer seed.")
@click.option("--device", default="cpu", show_default=True, help="Where to initialise the weights.")
def init_tiny_model(directory, preset, seed, device):
    """Write a random Qwen2.5-VL (or, with a qwen3vl preset, Qwen3-VL) checkpoint to DIRECTORY.

    The directory is a complete HF checkpoint (config, safetensors, tokenizer, image and video
    processors, chat template) that rlflow loads exactly like a downloaded one.
    """
    from rlflow.model.presets import QWEN3VL_PRESET_NAMES

    if preset in QWEN3VL_PRESET_NAMES:
        from rlflow.model.families.qwen3vl import QWEN3VL_PRESETS, write_tiny_qwen3vl

        sizes = QWEN3VL_PRESETS[preset]
        path = write_tiny_qwen3vl(directory, seed=seed, sizes=sizes, device=device)
        click.echo(f"wrote {preset} Qwen3-VL checkpoint to {path}")
        return
    from rlflow.model.tiny import PRESETS, write_tiny_checkpoint

    path = write_tiny_checkpoint(directory, seed=seed, sizes=PRESETS[preset], device=device)
    click.echo(f"wrote {preset} Qwen2.5-VL checkpoint to {path}")
