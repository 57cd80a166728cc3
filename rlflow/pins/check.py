"""One `rlflow check-pins` run: walk -> parse -> compare -> report (and `--fix`).

`main` reads the command's options itself, without click: check-pins runs as a pre-commit hook
on every commit, and importing click costs a fifth of a check. It reads only the forms it can
answer exactly as click would (the five options, `--opt value` or `--opt=value`); anything else
(`--help`, an unknown option, a bad value) returns None and the Click command in command.py
parses the line, so help and usage errors stay click's.

Exit codes: 0 consistent (warnings allowed), 1 findings (or a refused --fix), 2 unusable
input (not a git repository, missing or malformed pyproject.toml/.gitmodules, bad policy).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

from rlflow.errors import EXIT_FINDINGS, EXIT_OK, RlflowError, print_diagnostics
from rlflow.pins.records import record, replace

FLAGS = {"--strict": "strict", "--fix": "fix", "--example": "example"}
FORMATS = ("text", "json")


def main(argv: list[str]) -> int | None:
    """`rlflow check-pins ARGV` -> exit code, or None when click must parse ARGV."""
    parsed = parse_argv(argv)
    if parsed is None:
        return None
    repo, example, options = parsed
    try:
        try:
            return run_example(options) if example else run(repo, options)
        except RlflowError as err:
            print_usage_error(err, options.fmt)
            return err.exit_code
    except (KeyboardInterrupt, EOFError):  # what click prints for an Abort
        print("\nAborted.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `check-pins | head`: as click does, no traceback, exit 1
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush
        return 1


def parse_argv(argv: list[str]) -> tuple[Path, bool, Options] | None:
    """(repo, example, options) when every word is one click reads the same way, else None."""
    values = {"strict": False, "fix": False, "example": False, "repo": None, "fmt": "text"}
    words = iter(argv)
    for word in words:
        name, eq, value = word.partition("=")
        if word in FLAGS:
            values[FLAGS[word]] = True
            continue
        if name not in ("--repo", "--format"):
            return None  # --help, a short option, an unknown one, a positional argument
        if not eq:
            value = next(words, None)
            if value is None or value.startswith("-"):
                return None  # click's error, or a value click might read differently
        if name == "--format":
            if value not in FORMATS:
                return None
            values["fmt"] = value
        elif not value or _is_file(value):
            return None  # click's `Directory '...' is a file.`
        else:
            values["repo"] = value
    if values["example"] and values["repo"] is not None:
        return None  # click's usage error: --example checks its own repository
    options = Options(strict=values["strict"], fmt=values["fmt"], fix=values["fix"])
    return Path(values["repo"] or "."), values["example"], options


def _is_file(value: str) -> bool:
    import os
    import stat

    try:
        return stat.S_ISREG(os.stat(value).st_mode)
    except OSError:
        return False  # click.Path(exists=False) passes a path that does not exist


@record
class Options:
    strict: bool = False
    fmt: str = "text"
    fix: bool = False


@record
class Analysis:
    checkout: object  # model.Checkout
    root_text: str
    findings: list
    allowed: list
    checked: str  # "3 pyproject.toml files, 2 submodules"

    @property
    def exit_code(self) -> int:
        return EXIT_FINDINGS if any(f.severity == "error" for f in self.findings) else EXIT_OK


def run(repo: Path, options: Options) -> int:
    """One check (and fix). The cyclic garbage collector is paused meanwhile: the data is
    acyclic and freed by reference counts, so collections only cost time (a quarter of the
    CPU with 20,000 requirements: they rescan every object allocated so far)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run(repo, options)
    finally:
        if collecting:
            gc.enable()


def _run(repo: Path, options: Options) -> int:
    checkout = _walk_while_importing(repo)
    analysis = analyse(checkout, _read_root(checkout.root), options.strict)
    if options.fix:
        return fix_and_report(analysis, options)
    report(analysis, options.fmt)
    return analysis.exit_code


def _walk_while_importing(repo: Path):
    """walk(repo), run in a thread while this one imports what the check needs next (parse.py
    and compare.py bring tomllib and packaging: ~20 ms). The walk spends most of its time
    waiting for its git processes, so on two cores the two overlap; its result, or its error,
    is the same as when it runs alone."""
    import threading

    from rlflow.pins.walk import walk

    outcome: list = []

    def target() -> None:
        try:
            outcome.append(walk(repo))
        except BaseException as err:  # re-raised below, in this thread
            outcome.append(err)

    thread = threading.Thread(target=target, name="check-pins walk", daemon=True)
    thread.start()
    import rlflow.pins.compare  # noqa: F401  (what analyse() imports)
    import rlflow.pins.parse  # noqa: F401
    import rlflow.pins.policy  # noqa: F401

    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def run_example(options: Options) -> int:
    import tempfile

    from rlflow.pins.example import build_example

    with tempfile.TemporaryDirectory(prefix="rlflow-pins-example-") as tmp:
        root = build_example(Path(tmp))
        stream = sys.stderr if options.fmt == "json" else sys.stdout
        print(f"example repository (temporary, removed on exit): {root}\n", file=stream)
        return run(root, options)


def analyse(checkout, root_text: str, strict: bool) -> Analysis:
    """Parse every pyproject (the root from `root_text`), compare, apply the policy."""
    from rlflow.pins.compare import compare
    from rlflow.pins.parse import load_document, parse_document, read_manifest
    from rlflow.pins.policy import apply_allowlist, load_policy

    docs = [parse_document("pyproject.toml", root_text)]
    docs += [load_document(checkout.root, f"{p}/pyproject.toml") for p in checkout.pyprojects[1:]]
    manifests = [
        read_manifest(doc, project, checkout.root / project, is_root=project == "")
        for doc, project in zip(docs, checkout.pyprojects, strict=True)
    ]
    policy = load_policy(docs[0])
    findings = compare(manifests, checkout.submodules, policy)
    # The lock level and the refs policy are imported only when there is something for them
    # to read (a uv.lock, `submodule-refs`): their modules are a twentieth of a check.
    lock = checkout.root / "uv.lock"  # a directory or a FIFO there is read, and refused
    if policy.lock_level and (policy.deployed_locks or os.path.lexists(lock)):
        from rlflow.pins.lock.level import lock_findings

        findings += lock_findings(checkout.root, manifests, docs, policy)
    if policy.submodule_refs:
        from rlflow.pins.refs import ref_findings

        findings += ref_findings(checkout, policy)
    findings, allowed = apply_allowlist(findings, policy)
    if strict:
        findings = [replace(f, severity="error") for f in findings]
    return Analysis(checkout, root_text, findings, allowed, _checked(checkout))


def report(analysis: Analysis, fmt: str, extra: dict | None = None) -> None:
    from rlflow.pins import report as render

    if fmt == "json":
        document = render.json_document(
            analysis.findings, analysis.allowed, analysis.checked, analysis.exit_code
        )
        render.print_json({**document, **(extra or {})})
    else:
        render.print_text(
            analysis.findings, analysis.allowed, analysis.checked, analysis.checkout.root
        )


def fix_and_report(analysis: Analysis, options: Options) -> int:
    """Plan every edit; write nothing unless all are unambiguous and the result checks clean."""
    from rlflow.pins import fix

    plans = [(f, fix.plan(f, analysis.findings)) for f in analysis.findings]
    refused = [(f, p) for f, p in plans if isinstance(p, fix.Refusal)]
    edits = [p for _, p in plans if isinstance(p, fix.Edit)]
    if refused:
        lines = [f"not fixed [{f.code}] `{f.package}`: {p.reason}" for f, p in refused]
        _say("\n".join(["--fix refused; pyproject.toml left untouched:", *lines]), options)
        report(analysis, options.fmt, {"fix": {"applied": False, "refused": lines}})
        return EXIT_FINDINGS
    if not edits:
        report(analysis, options.fmt, {"fix": {"applied": False, "refused": []}})
        return analysis.exit_code
    new_text = fix.apply(analysis.root_text, edits)
    after = analyse(analysis.checkout, new_text, options.strict)
    left = [f for f in after.findings if isinstance(fix.plan(f, after.findings), fix.Edit)]
    if left:
        raise RlflowError(to_internal_error(left))
    root_file = analysis.checkout.root / "pyproject.toml"
    try:
        fix.write_atomically(root_file, new_text, analysis.root_text)
    except OSError as err:
        raise RlflowError(_write_error(err)) from None
    diff = fix.unified_diff(analysis.root_text, new_text, "pyproject.toml")
    _say(diff + f"fixed {len(edits)} pin{'s' * (len(edits) != 1)} in pyproject.toml\n", options)
    report(after, options.fmt, {"fix": {"applied": True, "diff": diff, "refused": []}})
    return after.exit_code


def _say(text: str, options: Options) -> None:
    """Human text for --fix: stdout in text mode, stderr when stdout carries JSON."""
    print(text, file=sys.stderr if options.fmt == "json" else sys.stdout)


def to_internal_error(left: list):
    from rlflow.errors import Diagnostic

    names = ", ".join(sorted({f"{f.code} `{f.package}`" for f in left}))
    return Diagnostic(
        "RF107",
        f"--fix did not resolve {names}; pyproject.toml left untouched",
        help="please report this; fix the pins by hand meanwhile",
    )


def _write_error(err: OSError):
    from rlflow.errors import Diagnostic

    return Diagnostic(
        "RF107",
        f"cannot write pyproject.toml: {err}",
        help="nothing was changed; check permissions and run again",
    )


def _read_root(root: Path) -> str:
    from rlflow.pins.parse import read_toml_text

    try:
        return read_toml_text(root / "pyproject.toml")
    except (OSError, UnicodeDecodeError) as err:
        from rlflow.errors import Diagnostic

        raise RlflowError(
            Diagnostic("RF102", f"cannot read pyproject.toml: {err}", file="pyproject.toml")
        ) from None


def _checked(checkout) -> str:
    subs = checkout.submodules
    missing = sum(not s.initialized for s in subs)
    files = len(checkout.pyprojects)
    text = f"{files} pyproject.toml file{'s' * (files != 1)}, {len(subs)} submodule{'s' * (len(subs) != 1)}"
    return text + (f" ({missing} not initialized)" if missing else "")


def print_usage_error(err: RlflowError, fmt: str) -> None:
    if fmt == "json":
        from rlflow.pins.report import print_json

        print_json(
            {
                "diagnostics": [d.to_json() for d in err.diagnostics],
                "allowed": [],
                "summary": "unusable input",
                "exit_code": err.exit_code,
            }
        )
        return
    print_diagnostics(err.diagnostics)
