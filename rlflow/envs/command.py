"""`rlflow setup-env`: build (or reuse) a per-node runtime environment. No torch import."""

from __future__ import annotations

import os

import click

from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError

ENV_NAMES = ("vllm",)


@click.command(
    epilog="""\b
Examples:
  rlflow setup-env vllm recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml
  rlflow setup-env vllm recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml --check   # built? exit 1 if not
  rlflow setup-env vllm recipes/base.yaml --device cuda --check   # the CUDA pin set, anywhere

\b
In a recipe, so every node builds it before training (`rlflow submit` runs it once per node):
  slurm:
    setup_command: uv run --frozen --no-sync rlflow setup-env vllm "$RLFLOW_RUN_DIR/recipe.yaml"
"""
)
@click.argument("name", type=click.Choice(ENV_NAMES))
@click.argument("recipe", required=False, type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default=None,
    help="Build this device kind's pin set (default: generation.vllm.device; auto detects).",
)
@click.option(
    "--check", is_flag=True, help="Only report whether the environment is built; exit 1 if not."
)
@click.option("--rebuild", is_flag=True, help="Remove and build again (nothing may be using it).")
@click.pass_context
def setup_env(ctx, name, recipe, overrides, device, check, rebuild):
    """Build a per-node runtime environment (vLLM) once per pin set, or reuse it.

    NAME is the environment (vllm). RECIPE gives its pins and location (generation.vllm);
    without it, $RLFLOW_RUN_DIR/recipe.yaml (under `rlflow submit`) or the base recipe's
    defaults. OVERRIDES are dotted key=value pairs. Prints the environment's path.
    """
    from rlflow.envs.build import EnvBuildError, ensure_env, is_ready
    from rlflow.envs.spec import vllm_spec

    cfg = _recipe(recipe, overrides).generation.vllm
    spec = vllm_spec(cfg, device)
    env_dir = spec.path(cfg.env_root)
    if check:
        ready = is_ready(spec, env_dir)
        click.echo(f"{'ready' if ready else 'missing'}: {env_dir}\n  {spec.describe()}")
        ctx.exit(0 if ready else EXIT_FINDINGS)
    try:
        env_dir = ensure_env(
            spec, cfg.env_root, rebuild=rebuild, say=lambda s: click.echo(s, err=True)
        )
    except EnvBuildError as err:
        raise RlflowError(
            Diagnostic(
                "env.build-failed",
                f"building the {name} environment failed",
                notes=tuple(str(err).splitlines()),
                help="fix the cause above and run the same command again; "
                "a half-built environment is removed first",
            ),
            exit_code=EXIT_FINDINGS,
        ) from None
    click.echo(env_dir)


def _recipe(path: str | None, overrides):
    from rlflow.rules import load_checked

    if path is None:
        run_dir = os.environ.get("RLFLOW_RUN_DIR")
        path = os.path.join(run_dir, "recipe.yaml") if run_dir else str(base_recipe())
    return load_checked(path, list(overrides)).recipe


def base_recipe():
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "recipes" / "base.yaml"
