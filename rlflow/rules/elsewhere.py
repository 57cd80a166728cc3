"""Recipe rules that ask another part of rlflow about a value (listed in checks.RULES).

Each asks the owner of a value whether it is good: the model-family registry about a built-in
checkpoint, rlflow.data about synthetic kinds, scenes, JSONL prompt templates and reward
functions, an optional package about being installed. Each imports its owner lazily and none
imports torch, so the login node's dry run runs them all. The rules between keys of the recipe
itself are in rlflow.rules.checks, which lists every rule once in `RULES`.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe.load import LoadedRecipe


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
