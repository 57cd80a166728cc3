"""Cross-field recipe rules: things no single key's type can say.

Each rule returns diagnostics that point at the key to change. `load_recipe` callers run
`check_recipe` right after loading, so a bad combination fails on the login node, never as a
KeyError or a hang on the allocation. Rules that also need the job's shape (data-parallel
divisibility, parallel sizes against nodes x GPUs) are in `rlflow.recipe.allocation`; both
`submit --dry-run` and `rlflow train` run both modules, and nothing else states these rules.
"""

from __future__ import annotations

import re
import shlex

from rlflow.data.dataset import SYNTHETIC_KINDS  # pure Python: rows are made lazily
from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe.allocation import PARALLEL_AXES
from rlflow.recipe.load import LoadedRecipe

_TIME_PATTERNS = [
    (re.compile(r"^(\d+)$"), lambda m: int(m[1]) * 60),
    (re.compile(r"^(\d+):(\d{1,2})$"), lambda m: int(m[1]) * 60 + int(m[2])),
    (
        re.compile(r"^(\d+):(\d{1,2}):(\d{1,2})$"),
        lambda m: int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]),
    ),
    (re.compile(r"^(\d+)-(\d{1,2})$"), lambda m: int(m[1]) * 86400 + int(m[2]) * 3600),
    (
        re.compile(r"^(\d+)-(\d{1,2}):(\d{1,2})$"),
        lambda m: int(m[1]) * 86400 + int(m[2]) * 3600 + int(m[3]) * 60,
    ),
    (
        re.compile(r"^(\d+)-(\d{1,2}):(\d{1,2}):(\d{1,2})$"),
        lambda m: int(m[1]) * 86400 + int(m[2]) * 3600 + int(m[3]) * 60 + int(m[4]),
    ),
]


def parse_time_limit(text: str) -> int | None:
    """Slurm's --time formats -> seconds; None if the text is not one of them."""
    for pattern, to_seconds in _TIME_PATTERNS:
        match = pattern.match(text.strip())
        if match:
            return to_seconds(match)
    return None


def check_recipe(loaded: LoadedRecipe) -> list[Diagnostic]:
    problems: list[Diagnostic] = []
    for rule in (
        _checkpoint,
        _video_keys,
        _datasets,
        _rewards,
        _grpo,
        _variants,
        _generation,
        _parallel_sizes,
        _cluster,
        _slurm,
        _checkpointing,
        _watchdog,
        _wandb,
    ):
        problems += rule(loaded)
    return problems


def _checkpoint(loaded: LoadedRecipe) -> list[Diagnostic]:
    from rlflow.model.family import unknown_builtin  # imports no torch (the family registry)

    problem = unknown_builtin(loaded.recipe.model.checkpoint)
    if problem is None:
        return []
    return [loaded.diagnostic(("model", "checkpoint"), problem.code, problem.message, problem.help)]


def _video_keys(loaded: LoadedRecipe) -> list[Diagnostic]:
    video = loaded.recipe.data.video
    values = {
        "num_frames": video.num_frames,
        "temporal_patch_size": video.temporal_patch_size,
        "fps": video.fps,
    }
    set_keys = [k for k, v in values.items() if v is not None]
    uses_video = any(_dataset_uses(loaded, split, "video") for split in ("train", "validation"))
    problems = []
    if set_keys and len(set_keys) < len(values):
        for key in values:
            if values[key] is None:
                problems.append(
                    loaded.diagnostic(
                        ("data", "video", set_keys[0]),
                        "recipe.video-incomplete",
                        f"`data.video.{key}` is not set, but `data.video.{set_keys[0]}` is",
                        help=f"set `data.video.{key}` too (the video settings go together), "
                        f"or set all of data.video to null",
                    )
                )
    elif uses_video and not set_keys:
        problems.append(
            loaded.diagnostic(
                ("data", "video"),
                "recipe.video-incomplete",
                "the data has video rows, but `data.video.num_frames`, `temporal_patch_size` and `fps` "
                "are not set",
                help="set data.video.num_frames (e.g. 4), data.video.temporal_patch_size (2 for "
                "Qwen2.5-VL) and data.video.fps (e.g. 2.0)",
            )
        )
    if video.num_frames is not None and video.temporal_patch_size:
        if video.num_frames % video.temporal_patch_size:
            problems.append(
                loaded.diagnostic(
                    ("data", "video", "num_frames"),
                    "recipe.video-frames",
                    f"`data.video.num_frames` ({video.num_frames}) is not a multiple of "
                    f"`temporal_patch_size` ({video.temporal_patch_size})",
                    help="Qwen2.5-VL folds temporal_patch_size frames into one patch: use a multiple",
                )
            )
    for key in ("num_frames", "temporal_patch_size"):
        if values[key] is not None and values[key] < 1:
            problems.append(
                loaded.diagnostic(
                    ("data", "video", key), "recipe.range", f"`data.video.{key}` must be at least 1"
                )
            )
    if video.fps is not None and video.fps <= 0:
        problems.append(
            loaded.diagnostic(
                ("data", "video", "fps"), "recipe.range", "`data.video.fps` must be positive"
            )
        )
    return problems


def _dataset_uses(loaded: LoadedRecipe, split: str, kind: str) -> bool:
    dataset = getattr(loaded.recipe.data, split)
    if dataset.kind == kind:
        return True
    return dataset.kind == "mixed" and loaded.recipe.data.mix.get(kind, 0) > 0


def _datasets(loaded: LoadedRecipe) -> list[Diagnostic]:
    data = loaded.recipe.data
    problems = []
    for split in ("train", "validation"):
        dataset = getattr(data, split)
        if dataset.kind == "jsonl" and not dataset.path:
            problems.append(
                loaded.diagnostic(
                    ("data", split, "kind"),
                    "recipe.jsonl-path",
                    f"`data.{split}.kind` is jsonl, but `data.{split}.path` is not set",
                    help=f"set data.{split}.path to a JSONL file with image, problem and solution fields",
                )
            )
        if dataset.num_samples < 1:
            problems.append(
                loaded.diagnostic(
                    ("data", split, "num_samples"),
                    "recipe.range",
                    f"`data.{split}.num_samples` must be at least 1",
                )
            )
    for kind, share in data.mix.items():
        if kind not in SYNTHETIC_KINDS:
            problems.append(
                loaded.diagnostic(
                    ("data", "mix", kind),
                    "recipe.unknown-key",
                    f"`data.mix.{kind}` is not a row type",
                    help="row types are " + ", ".join(SYNTHETIC_KINDS),
                )
            )
        elif share < 0:
            problems.append(
                loaded.diagnostic(
                    ("data", "mix", kind), "recipe.range", f"`data.mix.{kind}` must not be negative"
                )
            )
    if sum(max(v, 0) for v in data.mix.values()) <= 0 and "mixed" in (
        data.train.kind,
        data.validation.kind,
    ):
        problems.append(
            loaded.diagnostic(
                ("data", "mix"), "recipe.range", "`data.mix` shares must add up to more than 0"
            )
        )
    from rlflow.data.jsonl import first_rows_problems  # reads the files; imports no torch

    problems += first_rows_problems(data)  # the JSONL rows, read as the trainer will
    if data.image_size < 28:
        problems.append(
            loaded.diagnostic(
                ("data", "image_size"),
                "recipe.range",
                "`data.image_size` must be at least 28 pixels",
                help="Qwen2.5-VL needs at least one 2x2 block of 14-pixel patches",
            )
        )
    if data.max_objects < 1:
        problems.append(
            loaded.diagnostic(
                ("data", "max_objects"), "recipe.range", "`data.max_objects` must be at least 1"
            )
        )
    elif data.image_size >= 28 and _uses_synthetic(loaded):
        problems += _scene_fits(loaded)
    return problems


def _uses_synthetic(loaded: LoadedRecipe) -> bool:
    data = loaded.recipe.data
    return any(getattr(data, split).kind != "jsonl" for split in ("train", "validation"))


def _scene_fits(loaded: LoadedRecipe) -> list[Diagnostic]:
    """The scene layout's own rule (rlflow.data.scene, pure Python), pointed at the recipe."""
    from rlflow.data.scene import grid_for

    data = loaded.recipe.data
    try:
        grid_for(data.image_size, data.max_objects)
    except RlflowError as err:
        return [
            loaded.diagnostic(("data", "max_objects"), d.code, d.message, help=d.help)
            for d in err.diagnostics
        ]
    return []


def _rewards(loaded: LoadedRecipe) -> list[Diagnostic]:
    from rlflow.data.rewards import is_import_path, weight_problems  # pure Python, no torch
    from rlflow.data.user_rewards import check_import_path  # reads source, imports nothing

    problems = []
    for name in loaded.recipe.rewards:
        problem = check_import_path(name) if is_import_path(name) else None
        if problem:
            problems.append(
                loaded.diagnostic(
                    ("rewards", name), "recipe.reward-import", problem[0], help=problem[1]
                )
            )
    problems += [
        loaded.diagnostic(path, d.code, d.message, help=d.help)
        for path, d in weight_problems(loaded.recipe.rewards)
    ]
    return problems + _scoring(loaded)


def _scoring(loaded: LoadedRecipe) -> list[Diagnostic]:
    from rlflow.data.rewards import accuracy_problem, is_import_path
    from rlflow.data.user_rewards import check_import_path

    scoring = loaded.recipe.scoring
    problems = []
    reward = scoring.accuracy.split("/", 1)[0]
    problem = None
    if is_import_path(reward):
        if reward not in loaded.recipe.rewards:
            problem = check_import_path(reward)
    elif known := accuracy_problem(scoring.accuracy):
        problem = (known.message, known.help)
    if problem:
        problems.append(
            loaded.diagnostic(
                ("scoring", "accuracy"), "recipe.unknown-reward", problem[0], help=problem[1]
            )
        )
    if scoring.num_workers < 0:
        problems.append(
            loaded.diagnostic(
                ("scoring", "num_workers"), "recipe.range", "`scoring.num_workers` must be >= 0"
            )
        )
    if not scoring.timeout_s > 0:
        problems.append(
            loaded.diagnostic(
                ("scoring", "timeout_s"), "recipe.range", "`scoring.timeout_s` must be positive"
            )
        )
    return problems


def _variants(loaded: LoadedRecipe) -> list[Diagnostic]:
    """GSPO, overlong shaping, importance sampling, dynamic sampling: keys that go together."""
    loss, recipe = loaded.recipe.loss, loaded.recipe
    problems = []
    if loss.ratio_level == "sequence" and loss.token_level_loss:
        problems.append(
            loaded.diagnostic(
                ("loss", "ratio_level"),
                "recipe.gspo",
                "`loss.ratio_level: sequence` (GSPO) needs `loss.token_level_loss: false`",
                help="GSPO averages per sequence; set loss.token_level_loss: false (as NeMo-RL "
                "requires with sequence_level_importance_ratios)",
            )
        )
    overlong = loss.overlong_penalty
    max_new = recipe.generation.max_new_tokens
    if overlong.enabled and not 1 <= overlong.buffer_tokens <= max_new:
        problems.append(
            loaded.diagnostic(
                ("loss", "overlong_penalty", "buffer_tokens"),
                "recipe.range",
                f"`loss.overlong_penalty.buffer_tokens` ({overlong.buffer_tokens}) must be "
                f"between 1 and generation.max_new_tokens ({max_new})",
                help="the penalty ramps up over the last buffer_tokens of the generation budget",
            )
        )
    if overlong.penalty < 0:
        problems.append(
            loaded.diagnostic(
                ("loss", "overlong_penalty", "penalty"),
                "recipe.range",
                "`loss.overlong_penalty.penalty` must not be negative",
            )
        )
    sampling = loss.importance_sampling
    if not sampling.cap > 0:
        problems.append(
            loaded.diagnostic(
                ("loss", "importance_sampling", "cap"),
                "recipe.range",
                "`loss.importance_sampling.cap` must be positive",
            )
        )
    elif not 0 <= sampling.mask_below <= sampling.cap:
        problems.append(
            loaded.diagnostic(
                ("loss", "importance_sampling", "mask_below"),
                "recipe.range",
                f"`loss.importance_sampling.mask_below` must be between 0 and cap ({sampling.cap})",
            )
        )
    if recipe.grpo.dynamic_sampling.max_extra_rounds < 0:
        problems.append(
            loaded.diagnostic(
                ("grpo", "dynamic_sampling", "max_extra_rounds"),
                "recipe.range",
                "`grpo.dynamic_sampling.max_extra_rounds` must not be negative",
            )
        )
    problems += _prompt_template(loaded)
    return problems


def _prompt_template(loaded: LoadedRecipe) -> list[Diagnostic]:
    from rlflow.data.prompts import template_fields

    try:
        template_fields(loaded.recipe.data.prompt_template)
    except ValueError as exc:
        return [
            loaded.diagnostic(
                ("data", "prompt_template"),
                "recipe.prompt-template",
                f"`data.prompt_template` is not a valid template: {exc}",
                help='use {question} and JSONL column names in braces, e.g. "{question} Hint: '
                '{hint}"; write {{ and }} for literal braces',
            )
        ]
    return []


def _grpo(loaded: LoadedRecipe) -> list[Diagnostic]:
    grpo, loss, opt = loaded.recipe.grpo, loaded.recipe.loss, loaded.recipe.optimizer
    problems = []
    positive = [
        ("grpo", "num_prompts_per_step", grpo.num_prompts_per_step),
        ("grpo", "max_num_steps", grpo.max_num_steps),
        ("grpo", "max_val_samples", grpo.max_val_samples),
        ("grpo", "num_minibatches", grpo.num_minibatches),
        ("optimizer", "micro_batch_size", opt.micro_batch_size),
        ("warm_start", "batch_size", loaded.recipe.warm_start.batch_size),
    ]
    for section, key, value in positive:
        if value < 1:
            problems.append(
                loaded.diagnostic(
                    (section, key), "recipe.range", f"`{section}.{key}` must be at least 1"
                )
            )
    if grpo.num_generations_per_prompt < 2:
        problems.append(
            loaded.diagnostic(
                ("grpo", "num_generations_per_prompt"),
                "recipe.range",
                "`grpo.num_generations_per_prompt` must be at least 2",
                help="GRPO compares generations of the same prompt; one generation has no baseline",
            )
        )
    for section, key, value in [
        ("grpo", "val_period", grpo.val_period),
        ("warm_start", "num_steps", loaded.recipe.warm_start.num_steps),
        ("loss", "ratio_clip_low", loss.ratio_clip_low),
        ("loss", "ratio_clip_high", loss.ratio_clip_high),
        ("loss", "kl_penalty", loss.kl_penalty),
        ("optimizer", "max_grad_norm", opt.max_grad_norm),
        ("optimizer", "weight_decay", opt.weight_decay),
        ("optimizer", "max_tokens_per_micro_batch", opt.max_tokens_per_micro_batch),
    ]:
        if value < 0:
            problems.append(
                loaded.diagnostic(
                    (section, key), "recipe.range", f"`{section}.{key}` must not be negative"
                )
            )
    if loss.ratio_clip_low >= 1:
        problems.append(
            loaded.diagnostic(
                ("loss", "ratio_clip_low"),
                "recipe.range",
                "`loss.ratio_clip_low` must be below 1",
                help="the ratio is clipped to [1 - low, 1 + high]",
            )
        )
    if opt.lr <= 0:
        problems.append(
            loaded.diagnostic(
                ("optimizer", "lr"), "recipe.range", "`optimizer.lr` must be positive"
            )
        )
    return problems


def _generation(loaded: LoadedRecipe) -> list[Diagnostic]:
    gen = loaded.recipe.generation
    problems = []
    if gen.max_new_tokens < 1:
        problems.append(
            loaded.diagnostic(
                ("generation", "max_new_tokens"),
                "recipe.range",
                "`generation.max_new_tokens` must be at least 1",
            )
        )
    for key in ("temperature", "val_temperature"):
        if getattr(gen, key) < 0:
            problems.append(
                loaded.diagnostic(
                    ("generation", key),
                    "recipe.range",
                    f"`generation.{key}` must not be negative",
                    help="0 means greedy decoding",
                )
            )
    if not 0 < gen.top_p <= 1:
        problems.append(
            loaded.diagnostic(
                ("generation", "top_p"), "recipe.range", "`generation.top_p` must be in (0, 1]"
            )
        )
    if gen.top_k < 0:
        problems.append(
            loaded.diagnostic(
                ("generation", "top_k"),
                "recipe.range",
                "`generation.top_k` must not be negative",
                help="0 disables top-k",
            )
        )
    if gen.max_batch_size < 0:
        problems.append(
            loaded.diagnostic(
                ("generation", "max_batch_size"),
                "recipe.range",
                "`generation.max_batch_size` must be 0 (sized from free memory) or more",
            )
        )
    return problems + _vllm(loaded)


def _vllm(loaded: LoadedRecipe) -> list[Diagnostic]:
    vllm = loaded.recipe.generation.vllm
    where = ("generation", "vllm")
    problems = []
    for key in ("kv_cache_space_gb", "startup_timeout_s", "request_timeout_s"):
        if getattr(vllm, key) < 1:
            problems.append(
                loaded.diagnostic(
                    (*where, key), "recipe.range", f"`generation.vllm.{key}` must be at least 1"
                )
            )
    if not 0 < vllm.gpu_memory_utilization <= 1:
        problems.append(
            loaded.diagnostic(
                (*where, "gpu_memory_utilization"),
                "recipe.range",
                "`generation.vllm.gpu_memory_utilization` must be in (0, 1]",
                help="the share of the GPU vLLM may take; the trainer "
                "shares the GPU, so leave it room",
            )
        )
    for device in ("cpu", "cuda"):
        pins = getattr(vllm, device)
        if not re.fullmatch(r"3\.(8|9|[1-9]\d)", pins.python):  # 3.1 is YAML's reading of 3.10
            problems.append(
                loaded.diagnostic(
                    (*where, device, "python"),
                    "recipe.vllm-python",
                    f"`generation.vllm.{device}.python` is {pins.python!r}, not a Python 3.8+ version",
                    help='write it as a quoted string, e.g. "3.11" (YAML reads 3.10 as 3.1)',
                )
            )
        if not pins.packages:
            problems.append(
                loaded.diagnostic(
                    (*where, device, "packages"),
                    "recipe.range",
                    f"`generation.vllm.{device}.packages` is empty: the environment would hold no vLLM",
                    help='list pinned requirements, e.g. ["vllm==0.32.0"]',
                )
            )
    return problems


def _parallel_sizes(loaded: LoadedRecipe) -> list[Diagnostic]:
    par = loaded.recipe.parallelism
    problems = [
        loaded.diagnostic(
            ("parallelism", axis), "recipe.range", f"`parallelism.{axis}` must be at least 1"
        )
        for axis in PARALLEL_AXES
        if getattr(par, axis) < 1
    ]
    if par.pipeline_parallel_size > 1:
        problems.append(
            loaded.diagnostic(
                ("parallelism", "pipeline_parallel_size"),
                "recipe.pipeline-parallel",
                "rlflow's trainer runs with pipeline_parallel_size=1 for now",
                help="use tensor_parallel_size (and data parallelism) to spread the model",
            )
        )
    return problems


def _cluster(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`cluster` is the job's shape: `submit --nodes/--gpus` fills it; a recipe may assert it."""
    cluster = loaded.recipe.cluster
    return [
        loaded.diagnostic(
            ("cluster", key),
            "recipe.range",
            f"`cluster.{key}` must be at least 1 (or null: `rlflow submit` fills it)",
        )
        for key in ("num_nodes", "gpus_per_node")
        if getattr(cluster, key) is not None and getattr(cluster, key) < 1
    ]


def _slurm(loaded: LoadedRecipe) -> list[Diagnostic]:
    slurm = loaded.recipe.slurm
    problems = []
    seconds = parse_time_limit(slurm.time_limit)
    if seconds is None or seconds <= 0:
        problems.append(
            loaded.diagnostic(
                ("slurm", "time_limit"),
                "recipe.time-limit",
                f"`slurm.time_limit` is {slurm.time_limit!r}, which Slurm does not read as a time",
                help='use D-HH:MM:SS, HH:MM:SS, MM:SS or minutes, e.g. "04:00:00"',
            )
        )
    elif slurm.signal_grace_seconds >= seconds:
        problems.append(
            loaded.diagnostic(
                ("slurm", "signal_grace_seconds"),
                "recipe.range",
                f"`slurm.signal_grace_seconds` ({slurm.signal_grace_seconds}) must be shorter than the "
                f"time limit ({seconds} s)",
            )
        )
    if slurm.signal_grace_seconds < 1 or slurm.signal_grace_seconds > 65535:
        problems.append(
            loaded.diagnostic(
                ("slurm", "signal_grace_seconds"),
                "recipe.range",
                "`slurm.signal_grace_seconds` must be 1..65535",
            )
        )
    if slurm.max_requeues < 0:
        problems.append(
            loaded.diagnostic(
                ("slurm", "max_requeues"),
                "recipe.range",
                "`slurm.max_requeues` must not be negative",
            )
        )
    for name in slurm.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            problems.append(
                loaded.diagnostic(
                    ("slurm", "env", name),
                    "recipe.env-name",
                    f"`slurm.env.{name}` is not a valid environment variable name",
                    help="use letters, digits and underscores, not starting with a digit",
                )
            )
    if not slurm.rlflow_command.strip():
        problems.append(
            loaded.diagnostic(
                ("slurm", "rlflow_command"),
                "recipe.range",
                "`slurm.rlflow_command` must not be empty",
            )
        )
    else:
        try:
            shlex.split(slurm.rlflow_command)
        except ValueError as err:
            problems.append(
                loaded.diagnostic(
                    ("slurm", "rlflow_command"),
                    "recipe.rlflow-command",
                    f"`slurm.rlflow_command` is {slurm.rlflow_command!r}, which cannot be split "
                    f"into words: {err}",
                    help="balance the quotes, e.g. uv run --frozen rlflow",
                )
            )
    return problems


def _checkpointing(loaded: LoadedRecipe) -> list[Diagnostic]:
    ckpt = loaded.recipe.checkpointing
    problems = []
    for key in ("save_period", "keep_last"):
        if getattr(ckpt, key) < 1:
            problems.append(
                loaded.diagnostic(
                    ("checkpointing", key),
                    "recipe.range",
                    f"`checkpointing.{key}` must be at least 1",
                )
            )
    return problems


def _wandb(loaded: LoadedRecipe) -> list[Diagnostic]:
    """W&B is optional: a recipe that turns it on needs the package where it runs (the dry run
    asks on the login node, `rlflow train` on every node). Nothing is imported to ask."""
    from rlflow.train.wandb_log import INSTALL_HELP, missing_package

    cfg = loaded.recipe.logging.wandb
    problems = []
    if missing_package(cfg):
        problems.append(
            loaded.diagnostic(
                ("logging", "wandb", "enabled"),
                "recipe.wandb-missing",
                "`logging.wandb.enabled` is true, but the wandb package is not installed",
                help=INSTALL_HELP,
            )
        )
    if cfg.enabled and not cfg.project.strip():
        problems.append(
            loaded.diagnostic(
                ("logging", "wandb", "project"),
                "recipe.wandb-project",
                "`logging.wandb.project` is empty",
                help="name the W&B project the runs go to, e.g. project: vlm-grpo",
            )
        )
    return problems


def _watchdog(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Watchdog, preflight and retry keys (rlflow/launch/node.py, preflight.py, attempts.py)."""
    recipe = loaded.recipe
    watch, pre = recipe.watchdog, recipe.preflight
    problems = []
    at_least = [
        *(("watchdog", key, getattr(watch, key), 1) for key in _WATCHDOG_TIMEOUTS),
        ("preflight", "gemm_size", pre.gemm_size, 1),
        ("preflight", "allreduce_mb", pre.allreduce_mb, 0),
        ("preflight", "min_free_disk_gb", pre.min_free_disk_gb, 0),
        ("slurm", "max_failure_retries", recipe.slurm.max_failure_retries, 0),
    ]
    for section, key, value, low in at_least:
        if value < low:
            problems.append(
                loaded.diagnostic(
                    (section, key), "recipe.range", f"`{section}.{key}` must be at least {low}"
                )
            )
    if not pre.gemm_tolerance > 0:
        problems.append(
            loaded.diagnostic(
                ("preflight", "gemm_tolerance"),
                "recipe.range",
                "`preflight.gemm_tolerance` must be positive",
            )
        )
    if watch.enabled and watch.collective_timeout_s < watch.phase_timeout_s:
        problems.append(
            loaded.diagnostic(
                ("watchdog", "collective_timeout_s"),
                "recipe.range",
                f"`watchdog.collective_timeout_s` ({watch.collective_timeout_s}) is shorter than "
                f"`watchdog.phase_timeout_s` ({watch.phase_timeout_s})",
                help="a collective that times out first ends the job without naming the rank "
                "that stopped: make collective_timeout_s the longer of the two",
            )
        )
    return problems


_WATCHDOG_TIMEOUTS = (
    "startup_timeout_s",
    "preflight_timeout_s",
    "model_load_timeout_s",
    "checkpoint_timeout_s",
    "phase_timeout_s",
    "collective_timeout_s",
)
