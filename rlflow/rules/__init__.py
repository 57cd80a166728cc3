"""The recipe's rules: what a recipe must be before anything runs, the same on the login node
(`submit --dry-run`) and at `rlflow train`'s setup.

    checks.py      every rule between keys of the recipe, listed once in `RULES`
    elsewhere.py   rules that ask another package (the family registry, data/, optional packages)
    allocation.py  the rules of the job's shape: nodes x GPUs, parallel sizes, placement

They ask data/ and model/family.py, so they sit above both; the types they check are the
recipe's (rlflow/recipe/), at the bottom.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.errors import RlflowError


def load_checked(path: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """Load a recipe, validate types and cross-field rules; raise with every problem found."""
    from rlflow.recipe.load import load_recipe
    from rlflow.rules.checks import check_recipe

    loaded = load_recipe(path, overrides)
    problems = check_recipe(loaded)
    if problems:
        raise RlflowError(problems)
    return loaded
