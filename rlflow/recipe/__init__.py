"""Recipes: YAML files describing a whole run (see recipes/base.yaml)."""

from __future__ import annotations

from pathlib import Path

from rlflow.errors import RlflowError


def load_checked(path: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """Load a recipe, validate types and cross-field rules; raise with every problem found."""
    from rlflow.recipe.checks import check_recipe
    from rlflow.recipe.load import load_recipe

    loaded = load_recipe(path, overrides)
    problems = check_recipe(loaded)
    if problems:
        raise RlflowError(problems)
    return loaded
