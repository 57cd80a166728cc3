"""Settings that do nothing where they are set: refused with the reason, never ignored.

A key that only one backend, mode or switch reads (`generation.release_cache` under the hf
backend, `warm_start.lr` with no warm-start steps, `checkpointing.keep_last` with checkpointing
off) changes nothing when the recipe says otherwise: the user meant something that will not
happen. `INERT` lists each such key once, with the keys it depends on and when it is not read.
A value other than recipes/base.yaml's, there, is an error naming the key and the reason,
unless what switches it off was set later (a command-line `checkpointing.enabled=false` for a
recipe that sets `save_period`). Values of the chain's first file (base.yaml) are defaults, not
choices. Rules that need the model (MoE keys on a dense model) are rlflow.rules.elsewhere's
`moe_settings_fit_model`. Not listed: sections kept for when they are switched on or read by
another command (logging.wandb; generation.vllm, which `rlflow setup-env vllm` reads whatever
the backend).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlflow.errors import Diagnostic
from rlflow.recipe.bounds import bounded_values
from rlflow.recipe.load import LoadedRecipe
from rlflow.recipe.schema import Recipe

BASE = Path(__file__).resolve().parents[2] / "recipes" / "base.yaml"

# The keys a key's use depends on, and why it is not read (words after "does nothing: "), or
# None where it is.
Unread = tuple[tuple[str, ...], Callable[[Recipe], str | None]]


def _backend_not(backend: str) -> Unread:
    return (
        ("generation.backend",),
        lambda r: (
            f"`generation.backend` is {r.generation.backend}; only the {backend} backend reads it"
            if r.generation.backend != backend
            else None
        ),
    )


def _off(path: str, test: Callable[[Recipe], bool], state: str) -> Unread:
    return (path,), lambda r: f"`{path}` is {state}" if test(r) else None


def _not_jsonl(split: str) -> Unread:
    return _off(
        f"data.{split}.kind",
        lambda r: getattr(r.data, split).kind != "jsonl",
        "not jsonl (only jsonl reads it)",
    )


_NO_CHECKPOINTS = _off("checkpointing.enabled", lambda r: not r.checkpointing.enabled, "false")
_NO_WATCHDOG = _off("watchdog.enabled", lambda r: not r.watchdog.enabled, "false")
_NO_PREFLIGHT = _off("preflight.enabled", lambda r: not r.preflight.enabled, "false")


def sampling_mode(recipe: Recipe) -> str:
    """`loss.importance_sampling.mode` with `auto` resolved for the rollouts: tis for vllm, hf
    (another engine's numerics), FP8 megatron rollouts (quantized weights) and asynchronous
    GRPO (rollouts from older weights: async_grpo.max_staleness > 0) and partial rollouts (rows
    continued across updates: generation.partial_rollouts.enabled); off for synchronous
    megatron in the policy's dtype (the policy's own tensors: in fp32 the weights would be 1 to
    ~1e-7, so the loss is left exactly as is). The trainer runs this mode (train.collect)."""
    mode = recipe.loss.importance_sampling.mode
    if mode != "auto":
        return mode
    gen = recipe.generation
    synchronous = recipe.async_grpo.max_staleness == 0 and not gen.partial_rollouts.enabled
    return "off" if gen.backend == "megatron" and not gen.fp8 and synchronous else "tis"


_SAMPLING = (
    "loss.importance_sampling.mode",
    "generation.backend",
    "generation.fp8",
    "async_grpo.max_staleness",
    "generation.partial_rollouts.enabled",
)


def _sampling_unread(recipe: Recipe, reads: tuple[str, ...]) -> str | None:
    mode = sampling_mode(recipe)
    if mode in reads:
        return None
    said = recipe.loss.importance_sampling.mode
    resolved = f", which is {mode} for these rollouts" if said == "auto" else ""
    return f"`loss.importance_sampling.mode` is {said}{resolved}; only {' and '.join(reads)} " + (
        "read it" if len(reads) > 1 else "reads it"
    )


INERT: dict[str, Unread] = {
    "generation.share_prompts": _backend_not("megatron"),
    "generation.cuda_graphs": _backend_not("megatron"),
    "generation.compile_decode": _backend_not("megatron"),
    "generation.release_cache": _backend_not("megatron"),
    "model.tiny_seed": _off(
        "model.checkpoint",
        lambda r: not r.model.checkpoint.startswith("builtin:"),
        "not a builtin:tiny-* model",
    ),
    "data.train.path": _not_jsonl("train"),
    "data.train.image_root": _not_jsonl("train"),
    "data.validation.path": _not_jsonl("validation"),
    "data.validation.image_root": _not_jsonl("validation"),
    "data.mix": (
        ("data.train.kind", "data.validation.kind"),
        lambda r: (
            None
            if "mixed" in (r.data.train.kind, r.data.validation.kind)
            else "neither `data.train.kind` nor `data.validation.kind` is mixed"
        ),
    ),
    "scoring.timeout_s": _off(
        "scoring.num_workers",
        lambda r: r.scoring.num_workers == 0,
        "0 (rewards run in the trainer)",
    ),
    "grpo.dynamic_sampling.max_extra_rounds": _off(
        "grpo.dynamic_sampling.enabled", lambda r: not r.grpo.dynamic_sampling.enabled, "false"
    ),
    "loss.kl_type": _off("loss.kl_penalty", lambda r: r.loss.kl_penalty == 0, "0"),
    "loss.overlong_penalty.buffer_tokens": _off(
        "loss.overlong_penalty.enabled", lambda r: not r.loss.overlong_penalty.enabled, "false"
    ),
    "loss.overlong_penalty.penalty": _off(
        "loss.overlong_penalty.enabled", lambda r: not r.loss.overlong_penalty.enabled, "false"
    ),
    "loss.importance_sampling.cap": (_SAMPLING, lambda r: _sampling_unread(r, ("tis", "mis"))),
    "loss.importance_sampling.mask_below": (_SAMPLING, lambda r: _sampling_unread(r, ("mis",))),
    "optimizer.micro_batch_size": _off(
        "optimizer.max_tokens_per_micro_batch",
        lambda r: r.optimizer.max_tokens_per_micro_batch > 0,
        "above 0 (micro-batches are sized in tokens)",
    ),
    **{
        f"generation.partial_rollouts.{key}": _off(
            "generation.partial_rollouts.enabled",
            lambda r: not r.generation.partial_rollouts.enabled,
            "false",
        )
        for key in ("budget_steps", "finished_fraction", "max_staleness_steps")
    },
    "warm_start.lr": _off("warm_start.num_steps", lambda r: r.warm_start.num_steps == 0, "0"),
    "environment.max_turns": _off(
        "environment.kind", lambda r: r.environment.kind == "single_turn", "single_turn (one turn)"
    ),
    **{
        f"environment.{key}": _off(
            "environment.kind",
            lambda r: r.environment.kind == "single_turn",
            "single_turn (no task that can fail)",
        )
        for key in ("task_timeout_s", "on_task_failure")
    },
    "environment.tool_call_format": _off(
        "environment.kind", lambda r: r.environment.kind != "tool_scenes", "not tool_scenes"
    ),
    "warm_start.batch_size": _off(
        "warm_start.num_steps", lambda r: r.warm_start.num_steps == 0, "0"
    ),
    "checkpointing.save_period": _NO_CHECKPOINTS,
    "checkpointing.keep_last": _NO_CHECKPOINTS,
    "checkpointing.save_on_signal": _NO_CHECKPOINTS,
    "checkpointing.hf_export_keep_last": _off(
        "checkpointing.hf_export_period", lambda r: r.checkpointing.hf_export_period == 0, "0"
    ),
    "watchdog.startup_timeout_s": _NO_WATCHDOG,
    "watchdog.preflight_timeout_s": _NO_WATCHDOG,
    "watchdog.model_load_timeout_s": _NO_WATCHDOG,
    "watchdog.checkpoint_timeout_s": _NO_WATCHDOG,
    "watchdog.phase_timeout_s": _NO_WATCHDOG,
    "preflight.gemm_size": _NO_PREFLIGHT,
    "preflight.gemm_tolerance": _NO_PREFLIGHT,
    "preflight.allreduce_mb": _NO_PREFLIGHT,
    "preflight.min_free_disk_gb": _NO_PREFLIGHT,
    "slurm.container.apptainer_command": _off(
        "slurm.container.runtime",
        lambda r: r.slurm.container.runtime != "apptainer",
        "not apptainer",
    ),
    "slurm.container.apptainer_args": _off(
        "slurm.container.runtime",
        lambda r: r.slurm.container.runtime != "apptainer",
        "not apptainer",
    ),
}


@functools.cache
def base_defaults() -> dict | None:
    """recipes/base.yaml's values, typed as a recipe's (None where rlflow has no source tree)."""
    from rlflow.errors import RlflowError
    from rlflow.recipe.load import load_recipe

    try:
        return load_recipe(BASE).data if BASE.is_file() else None
    except RlflowError:  # (a schema the shipped base.yaml does not match: no defaults to compare)
        return None


def _value(data: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def _ranks(chain: LoadedRecipe) -> Callable[[str], int]:
    """How late a key was set: its file's place in the defaults chain (base.yaml first), then
    the command-line overrides in the order given (the loader keeps `origins` in that order)."""
    order = {key: i for i, key in enumerate(chain.origins)}
    files: dict[str, int] = {}  # origin.file (shown relative to the working directory) -> place

    def file_rank(shown: str) -> int:
        if shown not in files:
            where = Path(shown).resolve()
            places = [i for i, f in enumerate(chain.files) if f.resolve() == where]
            files[shown] = max(places, default=-1)
        return files[shown]

    def rank(dotted: str) -> int:
        path = tuple(dotted.split("."))
        key = next((path[:n] for n in range(len(path), 0, -1) if path[:n] in order), None)
        if key is None:
            return -1
        origin = chain.origins[key]
        if origin.is_command_line:
            return len(chain.files) + order[key]
        return file_rank(origin.file)

    return rank


def settings_that_do_nothing(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Each `INERT` key set to other than base.yaml's value where nothing reads it, unless what
    turns it off was set later (`checkpointing.enabled=false` on the command line, for a recipe
    that sets `save_period`, means what it says: that save_period was not this user's choice).
    The first file of the defaults chain (base.yaml) sets defaults, not choices: so the run's
    resolved recipe.yaml (one file) passes on the nodes as the dry run passed it."""
    ranked = _ranks(loaded)
    unread_keys = []
    for dotted, (depends, unread) in INERT.items():
        rank = ranked(dotted)
        if rank <= 0 or max(ranked(d) for d in depends) > rank:
            continue
        reason = unread(loaded.recipe)
        if reason is not None:
            unread_keys.append((dotted, reason))
    defaults = base_defaults() if unread_keys else None  # (read only when needed: ~20 ms)
    if defaults is None:
        return []
    out_of_bounds = {
        path[:n]
        for path, _, value, bound in bounded_values(loaded.recipe)
        if bound.problem(value) is not None
        for n in range(1, len(path) + 1)
    }  # (their own bound says what is wrong: one error per key, or section)
    return [
        loaded.diagnostic(
            tuple(dotted.split(".")),
            "recipe.does-nothing",
            f"`{dotted}` is set, but does nothing: {reason}",
            help=f"remove `{dotted}` from the recipe (or the override), or change what it "
            "depends on",
        )
        for dotted, reason in unread_keys
        if _value(loaded.data, dotted) != _value(defaults, dotted)
        and tuple(dotted.split(".")) not in out_of_bounds
    ]
