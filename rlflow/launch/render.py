"""JobPlan -> sbatch script text, through templates/sbatch.sh.j2.

StrictUndefined turns a misspelled field into an error instead of an empty string, and the
`q` filter (shlex.quote) is how every value reaches the script: a job name such as
`x"; touch /tmp/pwned; "` stays one word and never runs.

Compiling the template takes longer than rendering it, so its compiled code is cached the way
Python caches a module's (jinja2's bytecode cache, in ~/.cache/rlflow/templates): checked
against the template's text, rebuilt when it changes, never written with
PYTHONDONTWRITEBYTECODE set, and skipped where the cache directory cannot be written.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import sys
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
    options = dict(
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # shell, not HTML: quoting is the `q` filter's job
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        bytecode_cache=_bytecode_cache(jinja2, options),
        **options,
    )
    env.filters["q"] = quote
    return env


def _bytecode_cache(jinja2, options: dict):
    """A cache of compiled templates, or None. Its file names hold the jinja2 version and the
    environment's options, which the compiled code depends on and jinja2 does not check."""

    class Cache(jinja2.FileSystemBytecodeCache):
        def load_bytecode(self, bucket) -> None:
            try:
                super().load_bytecode(bucket)
            except Exception:  # a damaged file (jinja2 reads its checksum unguarded): recompile
                bucket.reset()

        def dump_bytecode(self, bucket) -> None:
            if sys.dont_write_bytecode:
                return
            try:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                super().dump_bytecode(bucket)
            except OSError:
                pass  # a cache only: rendering goes on without it

    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(cache_home):  # `~` unresolved (no HOME) or a relative setting
        return None
    flavour = repr(
        (getattr(jinja2, "__version__", ""), sorted((k, repr(v)) for k, v in options.items()))
    )
    tag = hashlib.sha1(flavour.encode()).hexdigest()[:12]
    return Cache(os.path.join(cache_home, "rlflow", "templates"), f"{tag}-%s.cache")
