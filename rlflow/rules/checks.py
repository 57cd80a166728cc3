"""Recipe rules that no single key's bound can say, all listed in `RULES`.

What one key may hold is declared beside it in rlflow.recipe.schema (`bound(...)`), and `_bounds`
below reports all of those at once. The other rules here relate two or more keys; the rules that ask
another part of rlflow about a value (the model-family registry, the reward registry, the scene
layout, the prompt-template reader, an optional package, the model's shape) are in
rlflow.rules.elsewhere, and keys that do nothing where they are set in rlflow.recipe.inert. Each
rule is one small function that returns diagnostics pointing at the key to change.

`load_recipe` callers run `check_recipe` right after loading, so a bad combination fails on the
login node, never as a KeyError or a hang on the allocation. Rules that also need the job's shape
(data-parallel divisibility, parallel sizes against nodes x GPUs, parallelism rlflow does not
implement) are in `rlflow.rules.allocation`; both `submit --dry-run` and `rlflow train` run both
modules, and nothing else states these rules.
"""

from __future__ import annotations

from rlflow.errors import Diagnostic
from rlflow.recipe.bounds import bounded_values
from rlflow.recipe.inert import settings_that_do_nothing
from rlflow.recipe.load import LoadedRecipe
from rlflow.recipe.scalars import parse_time_limit
from rlflow.rules.elsewhere import (
    accuracy_reward,
    builtin_checkpoint,
    engine_serves_model,
    generation_fits_model,
    heads_split_evenly,
    mix_kinds,
    moe_settings_fit_model,
    prompt_template,
    reward_functions,
    reward_weights,
    scene_fits,
    video_patch_matches_checkpoint,
    wandb_installed,
)
from rlflow.rules.environment import environment_fits
from rlflow.rules.gym import (
    gym_fits_engine,
    gym_installed,
    gym_needs_one_engine,
    gym_ports_distinct,
    gym_servers_defined,
)
from rlflow.rules.partial import partial_rollouts
from rlflow.rules.server import server_in_job


def check_recipe(loaded: LoadedRecipe) -> list[Diagnostic]:
    problems: list[Diagnostic] = []
    for rule in RULES:
        problems += rule(loaded)
    return problems


def _bounds(loaded: LoadedRecipe) -> list[Diagnostic]:
    """The one range rule: every value outside the bound its schema field declares."""
    problems = []
    for path, name, value, rule in bounded_values(loaded.recipe):
        message = rule.problem(value)
        if message is not None:
            help = rule.help_for(value)
            problems.append(loaded.diagnostic(path, rule.code, f"`{name}` {message}", help))
    return problems


# --- keys that go together ----------------------------------------------------------------------


def _video_keys_together(loaded: LoadedRecipe) -> list[Diagnostic]:
    """data.video: all three keys or none; and all three when the data has video rows."""
    video = loaded.recipe.data.video
    values = {
        "num_frames": video.num_frames,
        "temporal_patch_size": video.temporal_patch_size,
        "fps": video.fps,
    }
    set_keys = [k for k, v in values.items() if v is not None]
    if set_keys and len(set_keys) < len(values):
        return [
            loaded.diagnostic(
                ("data", "video", set_keys[0]),
                "recipe.video-incomplete",
                f"`data.video.{key}` is not set, but `data.video.{set_keys[0]}` is",
                help=f"set `data.video.{key}` too (the video settings go together), "
                f"or set all of data.video to null",
            )
            for key, value in values.items()
            if value is None
        ]
    if set_keys or not any(_uses(loaded, split, "video") for split in ("train", "validation")):
        return []
    return [
        loaded.diagnostic(
            ("data", "video"),
            "recipe.video-incomplete",
            "the data has video rows, but `data.video.num_frames`, `temporal_patch_size` and `fps` "
            "are not set",
            help="set data.video.num_frames (e.g. 4), data.video.temporal_patch_size (2 for "
            "Qwen2.5-VL) and data.video.fps (e.g. 2.0)",
        )
    ]


def _video_frames_fill_patches(loaded: LoadedRecipe) -> list[Diagnostic]:
    video = loaded.recipe.data.video
    frames, patch = video.num_frames, video.temporal_patch_size
    if frames is None or patch is None or patch < 1 or frames % patch == 0:
        return []
    return [
        loaded.diagnostic(
            ("data", "video", "num_frames"),
            "recipe.video-frames",
            f"`data.video.num_frames` ({frames}) is not a multiple of "
            f"`temporal_patch_size` ({patch})",
            help="Qwen2.5-VL folds temporal_patch_size frames into one patch: use a multiple",
        )
    ]


def _uses(loaded: LoadedRecipe, split: str, kind: str) -> bool:
    dataset = getattr(loaded.recipe.data, split)
    if dataset.kind == kind:
        return True
    return dataset.kind == "mixed" and loaded.recipe.data.mix.get(kind, 0) > 0


def _jsonl_needs_path(loaded: LoadedRecipe) -> list[Diagnostic]:
    return [
        loaded.diagnostic(
            ("data", split, "kind"),
            "recipe.jsonl-path",
            f"`data.{split}.kind` is jsonl, but `data.{split}.path` is not set",
            help=f"set data.{split}.path to a JSONL file with image, problem and solution fields",
        )
        for split in ("train", "validation")
        if getattr(loaded.recipe.data, split).kind == "jsonl"
        and not getattr(loaded.recipe.data, split).path
    ]


MAX_SYNTHETIC_ROWS = 10_000_000  # a synthetic split lists each row's kind up front (80 MB)


def _synthetic_rows_fit(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Synthetic rows are generated on access, but their kinds are listed when the split is
    built: a count past memory is refused here, not as a MemoryError on every rank."""
    return [
        loaded.diagnostic(
            ("data", split, "num_samples"),
            "recipe.range",
            f"`data.{split}.num_samples` ({getattr(loaded.recipe.data, split).num_samples}) is "
            f"more than {MAX_SYNTHETIC_ROWS:,} synthetic rows",
            help="a step samples num_prompts_per_step rows: a few thousand give every run "
            "fresh ones (jsonl: num_samples is a cap, any size)",
        )
        for split in ("train", "validation")
        if getattr(loaded.recipe.data, split).kind != "jsonl"
        and getattr(loaded.recipe.data, split).num_samples > MAX_SYNTHETIC_ROWS
    ]


def _jsonl_first_rows(loaded: LoadedRecipe) -> list[Diagnostic]:
    data = loaded.recipe.data
    if "jsonl" not in (data.train.kind, data.validation.kind):
        return []  # no JSONL split: the reader's modules (~12 ms) are not imported
    from rlflow.data.jsonl import first_rows_problems  # reads the files; imports no torch

    return first_rows_problems(loaded.recipe.data)  # the first rows, read as the trainer will


def _mix_adds_up(loaded: LoadedRecipe) -> list[Diagnostic]:
    data = loaded.recipe.data
    if "mixed" not in (data.train.kind, data.validation.kind):
        return []
    if sum(max(v, 0) for v in data.mix.values()) > 0:
        return []
    return [
        loaded.diagnostic(
            ("data", "mix"), "recipe.range", "`data.mix` shares must add up to more than 0"
        )
    ]


def _gspo_needs_sequence_loss(loaded: LoadedRecipe) -> list[Diagnostic]:
    loss = loaded.recipe.loss
    if not (loss.ratio_level == "sequence" and loss.token_level_loss):
        return []
    return [
        loaded.diagnostic(
            ("loss", "ratio_level"),
            "recipe.gspo",
            "`loss.ratio_level: sequence` (GSPO) needs `loss.token_level_loss: false`",
            help="GSPO averages per sequence; set loss.token_level_loss: false (as NeMo-RL "
            "requires with sequence_level_importance_ratios)",
        )
    ]


def _kv_cache_needs_megatron(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`generation.kv_cache_tokens` sizes the megatron engine's paged cache; the hf and vllm
    backends have no such cache (vllm's is `generation.vllm.gpu_memory_utilization`)."""
    gen = loaded.recipe.generation
    if not gen.kv_cache_tokens or gen.backend == "megatron":
        return []
    return [
        loaded.diagnostic(
            ("generation", "kv_cache_tokens"),
            "recipe.kv-cache-size",
            f"`generation.kv_cache_tokens: {gen.kv_cache_tokens}` sizes the megatron backend's "
            f"KV cache; backend `{gen.backend}` does not read it",
            help="set generation.kv_cache_tokens=0, or generation.backend=megatron",
        )
    ]


def _kv_cache_holds_a_row(loaded: LoadedRecipe) -> list[Diagnostic]:
    """A set KV cache must hold one whole row (the longest prompt + the generation budget):
    the engine refuses a row it can never fit, after the model is loaded."""
    gen, prompt = loaded.recipe.generation, loaded.recipe.data.max_prompt_tokens
    row = prompt + gen.max_new_tokens
    if not gen.kv_cache_tokens or gen.backend != "megatron" or gen.kv_cache_tokens >= row:
        return []  # (other backends: _kv_cache_needs_megatron says so)
    return [
        loaded.diagnostic(
            ("generation", "kv_cache_tokens"),
            "recipe.kv-cache-size",
            f"`generation.kv_cache_tokens` ({gen.kv_cache_tokens}) cannot hold one row of {row} "
            f"tokens (data.max_prompt_tokens {prompt} + generation.max_new_tokens "
            f"{gen.max_new_tokens})",
            help=f"set at least {row}, or 0 (sized from free GPU memory)",
        )
    ]


def _fp8_rollouts(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`generation.fp8` is the megatron engine's, in bf16 (torch's row-wise scaled matmul writes
    bf16), on FP8 GPUs: a CPU-only cluster is refused here; a CPU or pre-Ada GPU under `rlflow
    train` is refused by rlflow/generation/megatron/fp8.py's `require` before any model is loaded."""
    recipe = loaded.recipe
    if not recipe.generation.fp8:
        return []
    needs = [
        (recipe.generation.backend != "megatron", ("generation", "backend"),
         f"the megatron backend, not `{recipe.generation.backend}`", "generation.backend=megatron"),
        (recipe.model.dtype != "bfloat16", ("model", "dtype"),
         f"`model.dtype: bfloat16`, not `{recipe.model.dtype}`", "model.dtype=bfloat16"),
        (not recipe.slurm.request_gpus, ("slurm", "request_gpus"),
         "FP8 GPUs, but `slurm.request_gpus: false` says the job runs on CPUs", None),
    ]  # fmt: skip
    return [
        loaded.diagnostic(
            path,
            "recipe.fp8",
            f"`generation.fp8: true` needs {what}",
            help=f"set {fix}, or generation.fp8=false" if fix else "set generation.fp8=false",
        )
        for failed, path, what, fix in needs
        if failed
    ]


def _overlong_buffer_fits(loaded: LoadedRecipe) -> list[Diagnostic]:
    overlong = loaded.recipe.loss.overlong_penalty
    max_new = loaded.recipe.generation.max_new_tokens
    if not overlong.enabled or 1 <= overlong.buffer_tokens <= max_new:
        return []
    return [
        loaded.diagnostic(
            ("loss", "overlong_penalty", "buffer_tokens"),
            "recipe.range",
            f"`loss.overlong_penalty.buffer_tokens` ({overlong.buffer_tokens}) must be "
            f"between 1 and generation.max_new_tokens ({max_new})",
            help="the penalty ramps up over the last buffer_tokens of the generation budget",
        )
    ]


def _mask_below_cap(loaded: LoadedRecipe) -> list[Diagnostic]:
    sampling = loaded.recipe.loss.importance_sampling
    if not sampling.cap > 0 or 0 <= sampling.mask_below <= sampling.cap:
        return []  # (a cap of 0 or less is the cap's own bound)
    return [
        loaded.diagnostic(
            ("loss", "importance_sampling", "mask_below"),
            "recipe.range",
            f"`loss.importance_sampling.mask_below` must be between 0 and cap ({sampling.cap})",
        )
    ]


def _grace_before_time_limit(loaded: LoadedRecipe) -> list[Diagnostic]:
    slurm = loaded.recipe.slurm
    seconds = parse_time_limit(slurm.time_limit)  # None: the time limit's own bound says so
    if seconds is None or slurm.signal_grace_seconds < seconds:
        return []
    return [
        loaded.diagnostic(
            ("slurm", "signal_grace_seconds"),
            "recipe.range",
            f"`slurm.signal_grace_seconds` ({slurm.signal_grace_seconds}) must be shorter than the "
            f"time limit ({seconds} s)",
        )
    ]


def _collective_outlasts_phase(loaded: LoadedRecipe) -> list[Diagnostic]:
    watch = loaded.recipe.watchdog
    if not watch.enabled or watch.collective_timeout_s >= watch.phase_timeout_s:
        return []
    return [
        loaded.diagnostic(
            ("watchdog", "collective_timeout_s"),
            "recipe.range",
            f"`watchdog.collective_timeout_s` ({watch.collective_timeout_s}) is shorter than "
            f"`watchdog.phase_timeout_s` ({watch.phase_timeout_s})",
            help="a collective that times out first ends the job without naming the rank "
            "that stopped: make collective_timeout_s the longer of the two",
        )
    ]


def _sequence_parallel_needs_tensor_parallel(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Sequence parallelism splits activations over the tensor-parallel ranks: at TP=1 there
    is nothing to split, and megatron-core would quietly run without it."""
    par = loaded.recipe.parallelism
    if par.sequence_parallel != "on" or par.tensor_parallel_size > 1:
        return []
    return [
        loaded.diagnostic(
            ("parallelism", "sequence_parallel"),
            "recipe.sequence-parallel",
            "`parallelism.sequence_parallel` is on, but `parallelism.tensor_parallel_size` is 1: "
            "sequence parallelism splits activations over tensor-parallel ranks",
            help="set tensor_parallel_size > 1, or sequence_parallel: auto (on only when TP > 1)",
        )
    ]


def _mounts_need_an_image(loaded: LoadedRecipe) -> list[Diagnostic]:
    slurm = loaded.recipe.slurm
    if not slurm.container_mounts or slurm.container_image is not None:
        return []
    return [
        loaded.diagnostic(
            ("slurm", "container_mounts"),
            "submit.container",
            "`slurm.container_mounts` is set, but `slurm.container_image` is null",
            help="mounts only apply inside a container: set slurm.container_image, or remove them",
        )
    ]


def _runtime_matches_image(loaded: LoadedRecipe) -> list[Diagnostic]:
    """An image nothing would run, or a runtime without an image, is a recipe mistake."""
    slurm = loaded.recipe.slurm
    runtime, key = slurm.container.runtime, ("slurm", "container", "runtime")
    if runtime == "apptainer" and slurm.container_image is None:
        return [
            loaded.diagnostic(
                key,
                "submit.container",
                "`slurm.container.runtime` is apptainer, but `slurm.container_image` is null",
                help="set slurm.container_image to a .sif file or a docker:// image, or set "
                "slurm.container.runtime: none to run on the host",
            )
        ]
    if runtime == "none" and slurm.container_image is not None:
        return [
            loaded.diagnostic(
                key,
                "submit.container",
                f"`slurm.container.runtime` is none, but `slurm.container_image` is "
                f"{slurm.container_image!r}",
                help="set slurm.container.runtime to pyxis or apptainer to run in the image, or "
                "slurm.container_image: null to run on the host",
            )
        ]
    return []


def _apptainer_needs_a_command(loaded: LoadedRecipe) -> list[Diagnostic]:
    slurm = loaded.recipe.slurm
    if slurm.container.runtime != "apptainer" or slurm.container_image is None:
        return []  # (no image: _runtime_matches_image says so)
    if slurm.container.apptainer_command.strip():
        return []
    return [
        loaded.diagnostic(
            ("slurm", "container", "apptainer_command"),
            "submit.container",
            "`slurm.container.apptainer_command` is empty",
            help="set it to the executable on the nodes: apptainer or singularity",
        )
    ]


def _wandb_needs_a_project(loaded: LoadedRecipe) -> list[Diagnostic]:
    cfg = loaded.recipe.logging.wandb
    if not cfg.enabled or cfg.project.strip():
        return []
    return [
        loaded.diagnostic(
            ("logging", "wandb", "project"),
            "recipe.wandb-project",
            "`logging.wandb.project` is empty",
            help="name the W&B project the runs go to, e.g. project: vlm-grpo",
        )
    ]


# Every rule, in the order a user would fix things. A new rule is added here, and only here.
RULES = (
    _bounds,
    builtin_checkpoint,
    _video_keys_together,
    _video_frames_fill_patches,
    video_patch_matches_checkpoint,
    _jsonl_needs_path,
    _jsonl_first_rows,
    _synthetic_rows_fit,
    mix_kinds,
    _mix_adds_up,
    scene_fits,
    reward_functions,
    reward_weights,
    accuracy_reward,
    _gspo_needs_sequence_loss,
    _fp8_rollouts,
    _kv_cache_needs_megatron,
    _kv_cache_holds_a_row,
    server_in_job,
    partial_rollouts,
    _overlong_buffer_fits,
    _mask_below_cap,
    environment_fits,
    prompt_template,
    _grace_before_time_limit,
    _mounts_need_an_image,
    _runtime_matches_image,
    _apptainer_needs_a_command,
    _collective_outlasts_phase,
    _sequence_parallel_needs_tensor_parallel,
    heads_split_evenly,
    moe_settings_fit_model,
    generation_fits_model,
    engine_serves_model,
    settings_that_do_nothing,
    wandb_installed,
    _wandb_needs_a_project,
    gym_installed,
    gym_needs_one_engine,
    gym_servers_defined,
    gym_ports_distinct,
    gym_fits_engine,
)
