"""`rlflow check-pins` as a Click command: its help, and any command line check.py does not read.

The check itself, and the fast reading of the usual command lines, are in check.py."""

from __future__ import annotations

from pathlib import Path

import click

from rlflow.errors import RlflowError
from rlflow.pins.check import Options, print_usage_error, run, run_example

EPILOG = """\b
Examples:
  rlflow check-pins                      # the repository you are in
  rlflow check-pins --example            # the bundled emerging-optimizers incident (exits 1)
  rlflow check-pins --example --fix      # ... and its fix, as a diff
  rlflow check-pins --strict --format json --repo .

\b
Finding codes: RF001 conflicting git URL/rev, RF002 submodule URL pin not declared at the
root, RF003 index URL mismatch, RF004 disjoint versions, RF005 lockstep drift, RF006 gitlink
!= checkout, RF007 uninitialized submodule, RF008 uncommitted submodule pyproject, RF009
stale policy entry, RF010 a deployed submodule's uv.lock disagrees with the root's, RF011 stale
uv.lock, RF012 submodule commit not on its approved ref, RF013 lock freshness undecidable
offline, RF014 nested gitlink not committed in its parent. Policy: [tool.rlflow.pins] in the
root pyproject.toml (see docs/lockstep.md).
"""


# `--repo`, shared by check-pins and check-tests (rlflow/cicheck/command.py).
repo_option = click.option(
    "--repo",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("."),
    help="The repository to check (or any directory inside it).  [default: .]",
)


@click.command("check-pins", epilog=EPILOG)
@repo_option
@click.option(
    "--strict", is_flag=True, help="Treat warnings (e.g. uninitialized submodules) as errors."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one document for tools (CI, editors).",
)
@click.option(
    "--fix",
    is_flag=True,
    help="Move root pins to the submodules' values, keeping comments; print the diff.",
)
@click.option(
    "--example",
    is_flag=True,
    help="Build the bundled example repository (root pins emerging-optimizers v0.2.0, "
    "a nested Megatron-LM pins v0.3.0) in a temporary directory and check it.",
)
@click.pass_context
def check_pins(
    ctx: click.Context, repo: Path, strict: bool, fmt: str, fix: bool, example: bool
) -> None:
    """Check that submodule pyproject pins agree with the root pyproject.

    Walks the git submodules under the repository (nested ones included), reads every
    pyproject.toml, and reports pins that would make `uv lock` fail or drift: conflicting git
    revs, index URLs, disjoint versions, and submodules that are not at their recorded commit.
    """
    if example and ctx.get_parameter_source("repo") == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--example checks its own repository: drop --repo")
    options = Options(strict=strict, fmt=fmt, fix=fix)
    try:
        ctx.exit(run_example(options) if example else run(repo, options))
    except RlflowError as err:
        print_usage_error(err, fmt)
        ctx.exit(err.exit_code)
