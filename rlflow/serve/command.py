"""`rlflow serve`: a checkpoint behind the OpenAI Chat Completions API on this machine (Click).
Heavy imports stay inside the callback (`rlflow --help` imports this module, never torch)."""

from __future__ import annotations

from pathlib import Path

import click

DEFAULT_MODEL = "builtin:tiny-qwen25vl"


@click.command(
    epilog="""\b
Examples:
  rlflow serve                                   # the built-in tiny model, on 127.0.0.1:8000
  rlflow serve generation.server.port=8001       # the same, on another port
  rlflow serve /models/Qwen2.5-VL-3B-Instruct --port 8001
  rlflow serve recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml generation.server.max_rows=16
  rlflow serve /models/Qwen2.5-VL-3B-Instruct parallelism.tensor_parallel_size=2  # 2 GPUs
"""
)
@click.argument("checkpoint_or_recipe", default=DEFAULT_MODEL)
@click.argument("overrides", nargs=-1)
@click.option("--host", default=None, help="Listen address (default: generation.server.host).")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Port (default: generation.server.port; 0 picks a free one).")  # fmt: skip
@click.option("--model-name", default=None,
              help="The name clients send as `model` (default: the checkpoint's).")  # fmt: skip
def serve(checkpoint_or_recipe, overrides, host, port, model_name):
    """Serve a checkpoint (or a recipe's) over the OpenAI Chat Completions API, CPU or GPU.

    CHECKPOINT_OR_RECIPE is an HF checkpoint directory, builtin:NAME, or a YAML recipe (its
    model.checkpoint is served); OVERRIDES are dotted key=value pairs of the recipe
    (generation.server.* sizes the server; parallelism.tensor_parallel_size=N splits the
    model over N local ranks). The server prints its URL when it is ready.
    """
    from rlflow.serve.start import serve_forever

    overrides = list(overrides)
    if "=" in checkpoint_or_recipe and not Path(checkpoint_or_recipe).exists():
        overrides.insert(0, checkpoint_or_recipe)  # `rlflow serve key=value`: the default model
        checkpoint_or_recipe = DEFAULT_MODEL
    recipe, checkpoint = _recipe_and_checkpoint(checkpoint_or_recipe, overrides)
    serve_forever(recipe, checkpoint, host=host, port=port, model_name=model_name)


def _recipe_and_checkpoint(target: str, overrides: list[str]):
    """(the checked recipe, the `model.checkpoint` it serves)."""
    from rlflow.rules import load_checked

    if target.endswith((".yaml", ".yml")):
        recipe = load_checked(target, overrides).recipe
        return recipe, recipe.model.checkpoint
    base = Path(__file__).resolve().parents[2] / "recipes" / "base.yaml"
    if not base.is_file():
        raise click.UsageError(
            f"{base} is missing: pass a recipe (defaults: base.yaml) instead of a checkpoint"
        )
    recipe = load_checked(base, [f"model.checkpoint={target}", *overrides]).recipe
    return recipe, target
