"""JobPlan -> sbatch script text, through templates/sbatch.sh.j2.

StrictUndefined turns a misspelled field into an error instead of an empty string, and the
`q` filter (shlex.quote) is how every value reaches the script: a job name such as
`x"; touch /tmp/pwned; "` stays one word and never runs.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from rlflow.errors import JOB_EXIT_CODES, Diagnostic, RlflowError
from rlflow.job import files
from rlflow.launch.plan import JobPlan

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "templates"
TEMPLATE_NAME = "sbatch.sh.j2"


def render(plan: JobPlan) -> str:
    """The sbatch script for `plan`; `exit` holds the job's exit codes (rlflow.errors), `files`
    the names of the run directory's files it tests (rlflow.job.files)."""
    template = _environment().get_template(TEMPLATE_NAME)
    return template.render(plan=plan, exit=JOB_EXIT_CODES, files=files)


def render_template(name: str, **values: object) -> str:
    """Another template in templates/ (the sweep's array script), with the same `q` filter."""
    return _environment().get_template(name).render(**values)


def quote(value: object) -> str:
    """The `q` filter: one shell word, whatever the value holds."""
    # None would quote to the word 'None'; the template must test optional values first.
    assert value is not None, "the template quoted a None value; guard it with `is not none`"
    return shlex.quote(str(value))


def _environment():
    import jinja2  # ~30 ms; only submit needs it

    if not (TEMPLATE_DIR / TEMPLATE_NAME).is_file():
        raise RlflowError(
            Diagnostic(
                "submit.template-missing",
                f"the sbatch template {TEMPLATE_DIR / TEMPLATE_NAME} is missing",
                help="rlflow submit renders templates/ from its source checkout: run it from a clone "
                "installed with `uv sync`",
            )
        )
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # shell, not HTML: quoting is the `q` filter's job
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = quote
    return env
