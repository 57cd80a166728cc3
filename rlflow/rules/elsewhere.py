"""Recipe rules that ask another part of rlflow about a value (listed in checks.RULES).

Each asks the owner of a value whether it is good: the model-family registry about a built-in
checkpoint, rlflow.model.shape about the model's sizes (heads and KV heads against tensor
parallelism, experts against `model.moe`, positions and KV-cache bytes against the generation
lengths), rlflow.data about synthetic kinds, scenes, JSONL prompt templates and reward
functions, an optional package about being installed. Each imports its owner lazily and none
imports torch, so the login node's dry run runs them all. The rules between keys of the recipe
itself are in rlflow.rules.checks, which lists every rule once in `RULES`.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe.load import LoadedRecipe
from rlflow.recipe.schema import MAX_TOKENS


def builtin_checkpoint(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`builtin:NAME` must name a family's tiny checkpoint (rlflow.model.family)."""
    from rlflow.model.family import unknown_builtin

    problem = unknown_builtin(loaded.recipe.model.checkpoint)
    if problem is None:
        return []
    return [loaded.diagnostic(("model", "checkpoint"), problem.code, problem.message, problem.help)]


def mix_kinds(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`data.mix` keys must be synthetic row types (rlflow.data.dataset)."""
    from rlflow.data.dataset import SYNTHETIC_KINDS

    return [
        loaded.diagnostic(
            ("data", "mix", kind),
            "recipe.unknown-key",
            f"`data.mix.{kind}` is not a row type",
            help="row types are " + ", ".join(SYNTHETIC_KINDS),
        )
        for kind in loaded.recipe.data.mix
        if kind not in SYNTHETIC_KINDS
    ]


def scene_fits(loaded: LoadedRecipe) -> list[Diagnostic]:
    """The scene layout's own rule (rlflow.data.scene), for synthetic data."""
    from rlflow.data.scene import grid_for

    data = loaded.recipe.data
    synthetic = any(getattr(data, split).kind != "jsonl" for split in ("train", "validation"))
    if not synthetic or data.image_size < 28 or data.max_objects < 1:
        return []  # (sizes out of range: their own bounds say so)
    try:
        grid_for(data.image_size, data.max_objects)
    except RlflowError as err:
        return [
            loaded.diagnostic(("data", "max_objects"), d.code, d.message, help=d.help)
            for d in err.diagnostics
        ]
    return []


def reward_functions(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`package.module:function` rewards must exist (read from source: nothing is imported)."""
    from rlflow.data.rewards import is_import_path
    from rlflow.data.user_rewards import check_import_path

    problems = []
    for name in loaded.recipe.rewards:
        problem = check_import_path(name) if is_import_path(name) else None
        if problem:
            problems.append(
                loaded.diagnostic(
                    ("rewards", name), "recipe.reward-import", problem[0], help=problem[1]
                )
            )
    return problems


def reward_weights(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Known names, finite weights that add up to more than 0 (stated in rlflow.data.rewards)."""
    from rlflow.data.rewards import weight_problems

    return [
        loaded.diagnostic(path, d.code, d.message, help=d.help)
        for path, d in weight_problems(loaded.recipe.rewards)
    ]


def accuracy_reward(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`scoring.accuracy` names a reward of the recipe, a registered one, or an import path."""
    from rlflow.data.rewards import accuracy_problem, is_import_path
    from rlflow.data.user_rewards import check_import_path

    scoring = loaded.recipe.scoring
    reward = scoring.accuracy.split("/", 1)[0]
    problem = None
    if is_import_path(reward):
        if reward not in loaded.recipe.rewards:
            problem = check_import_path(reward)
    elif known := accuracy_problem(scoring.accuracy):
        problem = (known.message, known.help)
    if not problem:
        return []
    return [
        loaded.diagnostic(
            ("scoring", "accuracy"), "recipe.unknown-reward", problem[0], help=problem[1]
        )
    ]


def video_patch_matches_checkpoint(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`data.video.temporal_patch_size` must be the checkpoint's own: the processor folds that
    many frames into a patch whatever the recipe says (read from its JSON, no torch). Run by the
    dry run and by `rlflow train`, wherever the checkpoint directory is there to read."""
    import json

    wanted = loaded.recipe.data.video.temporal_patch_size
    folder = Path(loaded.recipe.model.checkpoint).expanduser()
    if wanted is None or not folder.is_dir():
        return []  # (builtin: checkpoints fold 2 frames, the value their recipes set)
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        try:
            own = json.loads((folder / name).read_text()).get("temporal_patch_size")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(own, int) and own != wanted:
            return [
                loaded.diagnostic(
                    ("data", "video", "temporal_patch_size"),
                    "recipe.video-patch",
                    f"`data.video.temporal_patch_size` is {wanted}, but the checkpoint's video "
                    f"processor folds {own} frames into a patch ({folder / name})",
                    help=f"set data.video.temporal_patch_size: {own} (and num_frames a multiple "
                    f"of it)",
                )
            ]
        if isinstance(own, int):
            return []
    return []


def prompt_template(loaded: LoadedRecipe) -> list[Diagnostic]:
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


def wandb_installed(loaded: LoadedRecipe) -> list[Diagnostic]:
    """W&B is optional: a recipe that turns it on needs the package where it runs (the dry run
    asks on the login node, `rlflow train` on every node). Nothing is imported to ask."""
    from rlflow.optional import WANDB_INSTALL_HELP as INSTALL_HELP
    from rlflow.optional import wandb_missing as missing_package

    if not missing_package(loaded.recipe.logging.wandb):
        return []
    return [
        loaded.diagnostic(
            ("logging", "wandb", "enabled"),
            "recipe.wandb-missing",
            "`logging.wandb.enabled` is true, but the wandb package is not installed",
            help=INSTALL_HELP,
        )
    ]


# --- the model's shape (rlflow.model.shape: the builtin's sizes or config.json, no torch) ------

_LARGEST_GPU_GIB = 288  # no GPU rlflow runs on holds more (B300: 288 GB)


def engine_serves_model(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`generation.backend: megatron` needs a model the engine runs: a family it serves
    (ModelFamily.megatron_engine) and, for a hybrid (its layer kinds, `hybrid_blocks`, with or
    without mixture-of-experts `E` layers), no `generation.fp8`
    (rlflow/generation/megatron/hybrid_decoder.py)."""
    import json
    from pathlib import Path

    from rlflow.model import family as families
    from rlflow.model.shape import hybrid_blocks

    recipe = loaded.recipe
    if recipe.generation.backend != "megatron":
        return []
    checkpoint = recipe.model.checkpoint
    if checkpoint.startswith(families.BUILTIN_PREFIX):
        name = checkpoint[len(families.BUILTIN_PREFIX) :]
        family = families.by_builtin(name)
        sized = getattr(family, "builtin_config", None)
        config = sized(name) if sized is not None else {}
    else:
        try:
            config = json.loads((Path(checkpoint).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return []  # the checkpoint's own rules report it
        family = families.by_config(config) if isinstance(config, dict) else None
    if family is None:
        return []
    blocks = hybrid_blocks(config)  # (Nemotron Omni's are in its `llm_config`)
    why = None
    if not family.megatron_engine:
        why = "a model whose layers keep a state the engine does not hold yet"
    elif blocks and recipe.generation.fp8:
        return [
            loaded.diagnostic(
                ("generation", "fp8"),
                "generation.megatron-engine",
                "`generation.fp8` is true, but the engine has no FP8 decode for a hybrid model "
                f"({checkpoint}, {family.architectures[0]})",
                help="set generation.fp8: false (docs/hybrid-kernels.md)",
            )
        ]
    if why is None:
        return []
    return [
        loaded.diagnostic(
            ("generation", "backend"),
            "generation.megatron-engine",
            f"`generation.backend` is megatron, whose engine does not serve `model.checkpoint` "
            f"({checkpoint}, {family.architectures[0]}: {why})",
            help="set generation.backend: hf (docs/hybrid-kernels.md, what is left)",
        )
    ]


def _shape(recipe):
    from rlflow.model.shape import recipe_shape

    return recipe_shape(recipe.model.checkpoint)


def heads_split_evenly(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Tensor parallelism gives each rank an equal share of the attention heads and of the KV
    heads (megatron-core asserts it while building the model, on every rank): the trainer's
    `parallelism.tensor_parallel_size` and, under separate placement, the generation engine's.

    A hybrid (Nemotron-H, Nemotron Omni) may also use a multiple of its KV heads: megatron-core
    then gives each rank one KV head, shared with its group's other ranks, and the engine's
    hybrid decoder does the same (decoder._gather_kv; tests/generation/
    test_generation_hybrid_tensor_parallel.py). The engine's GPT decoder does not: refused."""
    recipe, shape = loaded.recipe, _shape(loaded.recipe)
    if shape is None or not shape.heads:
        return []
    sizes = [("parallelism", "tensor_parallel_size")]
    if recipe.generation.placement == "separate":
        sizes.append(("generation", "tensor_parallel_size"))
    hybrid = shape.kv_layers >= 0
    problems = []
    for path in sizes:
        tp = getattr(getattr(recipe, path[0]), path[1])
        shared = hybrid and tp > shape.kv_heads and tp % shape.kv_heads == 0
        counts = (
            (shape.heads, "attention heads"),
            (shape.kv_heads, "KV heads"),
            (shape.mamba_heads, "Mamba heads"),
            (shape.mamba_groups, "Mamba B/C groups"),
        )
        bad = [f"{n} {what}" for n, what in counts if n and tp > 0 and n % tp]  # fmt: skip
        if shared:
            bad = [b for b in bad if not b.endswith("KV heads")]
        if bad:
            fits = [d for d in range(1, shape.heads + 1) if _splits_heads(shape, d, hybrid)]
            problems.append(
                loaded.diagnostic(
                    path,
                    "recipe.tensor-parallel-heads",
                    f"`{'.'.join(path)}` ({tp}) does not divide the {_listed(bad)} of "
                    f"`model.checkpoint` ({recipe.model.checkpoint})",
                    help="each tensor-parallel rank holds an equal share of the heads"
                    + (" (of a hybrid's KV heads: or one, shared)" if hybrid else "")
                    + f": choose one of {', '.join(map(str, fits))}",
                )
            )
    return problems


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _splits_heads(shape, tp: int, hybrid: bool) -> bool:
    """tp ranks take equal shares of the heads, the KV heads (a hybrid's: or share them) and a
    hybrid's Mamba heads and groups (megatron-core's MambaMixer asserts both)."""
    kv = shape.kv_heads
    mamba = all(n % tp == 0 for n in (shape.mamba_heads, shape.mamba_groups) if n)
    return shape.heads % tp == 0 and mamba and (kv % tp == 0 or (hybrid and tp % kv == 0))


def moe_settings_fit_model(loaded: LoadedRecipe) -> list[Diagnostic]:
    """`model.moe.router_topk` picks among the model's experts. On a dense model the `model.moe`
    keys and `loss.router_replay`, and on a text-only one `model.freeze_vision`, do nothing: a
    value other than the one that changes nothing (base.yaml's) is refused with the reason."""
    recipe, shape = loaded.recipe, _shape(loaded.recipe)
    if shape is None:
        return []
    moe, where = recipe.model.moe, f"`model.checkpoint` ({recipe.model.checkpoint})"
    problems = []
    if shape.experts and moe.router_topk is not None and moe.router_topk > shape.experts:
        problems.append(  # (below 1: its bound in the schema says so)
            loaded.diagnostic(
                ("model", "moe", "router_topk"),
                "recipe.moe-router-topk",
                f"`model.moe.router_topk` is {moe.router_topk}, but {where} has "
                f"{shape.experts} experts",
                help=f"choose 1..{shape.experts}, or null for the checkpoint's "
                f"num_experts_per_tok ({shape.topk})",
            )
        )
    dense, text = "a dense model", "a text-only model (no vision tower)"
    inert = [
        (("model", "freeze_vision"), not recipe.model.freeze_vision and not shape.multimodal, text),
    ]
    if not shape.experts:
        inert += [
            (("model", "moe", "grouped_experts"), not moe.grouped_experts, dense),
            (("model", "moe", "router_topk"), moe.router_topk is not None, dense),
            (("model", "moe", "router_dtype"), moe.router_dtype is not None, dense),
            (("model", "moe", "aux_loss_coeff"), moe.aux_loss_coeff is not None, dense),
            (("model", "moe", "z_loss_coeff"), moe.z_loss_coeff != 0, dense),
            (("loss", "router_replay"), not recipe.loss.router_replay, dense),
        ]
    return problems + [
        loaded.diagnostic(
            path,
            "recipe.does-nothing",
            f"`{'.'.join(path)}` is set, but does nothing: {where} is {what}",
            help=f"remove `{'.'.join(path)}` from the recipe (or the override), or train a "
            + ("mixture-of-experts checkpoint" if what == dense else "vision-language model"),
        )
        for path, changed, what in inert
        if changed
    ]


def generation_fits_model(loaded: LoadedRecipe) -> list[Diagnostic]:
    """A prompt and its generation must fit the positions the model was built for
    (max_position_embeddings), and a KV cache sized in `generation.kv_cache_tokens` must fit in
    one GPU's memory: otherwise the job dies allocating it."""
    recipe, shape = loaded.recipe, _shape(loaded.recipe)
    if shape is None:
        return []
    prompt, new = recipe.data.max_prompt_tokens, recipe.generation.max_new_tokens
    problems = []
    if (
        shape.max_positions
        and prompt + new > shape.max_positions
        and max(prompt, new) <= MAX_TOKENS
    ):
        problems.append(
            loaded.diagnostic(
                ("generation", "max_new_tokens"),
                "recipe.context-length",
                f"`data.max_prompt_tokens` ({prompt}) + `generation.max_new_tokens` ({new}) "
                f"is more than the {shape.max_positions} positions of `model.checkpoint` "
                f"({recipe.model.checkpoint}, max_position_embeddings)",
                help=f"lower generation.max_new_tokens to at most "
                f"{max(shape.max_positions - prompt, 1)} (or data.max_prompt_tokens)",
            )
        )
    tokens = recipe.generation.kv_cache_tokens
    if tokens and shape.layers and shape.head_dim and recipe.slurm.request_gpus:
        dtype_bytes = 2 if recipe.model.dtype == "bfloat16" else 4
        tp = recipe.generation.tensor_parallel_size
        if recipe.generation.placement != "separate":
            tp = recipe.parallelism.tensor_parallel_size
        gib = tokens * shape.kv_bytes_per_token(dtype_bytes, tp) / 2**30
        if gib > _LARGEST_GPU_GIB:
            problems.append(
                loaded.diagnostic(
                    ("generation", "kv_cache_tokens"),
                    "recipe.kv-cache-size",
                    f"`generation.kv_cache_tokens` ({tokens}) makes a KV cache of {gib:,.0f} GiB "
                    f"per rank for `model.checkpoint` ({recipe.model.checkpoint}, "
                    f"{recipe.model.dtype}), more than any GPU holds ({_LARGEST_GPU_GIB} GB)",
                    help="set 0 (half of the free GPU memory at each rollout), or at most "
                    f"{int(_LARGEST_GPU_GIB * 2**30 // shape.kv_bytes_per_token(dtype_bytes, tp))}",
                )
            )
    return problems
