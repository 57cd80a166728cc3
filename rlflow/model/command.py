"""`rlflow init-tiny-model`: write a random Qwen2.5-VL checkpoint built in code (no downloads)."""

from __future__ import annotations

import click

from rlflow.model.presets import PRESET_NAMES


@click.command(
    epilog="""\b
Examples:
  rlflow init-tiny-model /tmp/tiny-vlm
  rlflow init-tiny-model /scratch/qwen25vl-3b-random --preset qwen25vl-3b --device cuda
"""
)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--preset",
    type=click.Choice(PRESET_NAMES),
    default="tiny",
    show_default=True,
    help="tiny: ~1 M parameters for CPU tests; qwen25vl-3b: the real 3B shapes.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Weight and tokenizer seed.")
@click.option("--device", default="cpu", show_default=True, help="Where to initialise the weights.")
def init_tiny_model(directory, preset, seed, device):
    """Write a random Qwen2.5-VL checkpoint to DIRECTORY.

    The directory is a complete HF checkpoint (config, safetensors, tokenizer, image and video
    processors, chat template) that rlflow loads exactly like a downloaded one.
    """
    from rlflow.model.tiny import PRESETS, write_tiny_checkpoint

    path = write_tiny_checkpoint(directory, seed=seed, sizes=PRESETS[preset], device=device)
    click.echo(f"wrote {preset} Qwen2.5-VL checkpoint to {path}")
