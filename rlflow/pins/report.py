"""Findings -> compiler-style diagnostics (text) or one JSON document (tools).

Each diagnostic points at the line to edit (the root pin when there is one), names the
package and both values, lists every other place involved as a note with file:line, and ends
with the fix: `help: set rev = "v0.3.0" at pyproject.toml:12`.
"""

from __future__ import annotations

import sys

from rlflow.errors import Diagnostic, summary_line
from rlflow.pins.model import Finding, IndexDef, Pin

UV_SAYS = {
    "RF001": "uv lock would fail: Requirements contain conflicting URLs for package `{package}` "
    "(unless both refs name the same commit)",
    "RF003": "uv lock would fail for packages from this index: Requirements contain "
    "conflicting indexes",
    "RF004": "uv lock would fail: No solution found when resolving dependencies",
}


def to_diagnostic(finding: Finding, findings: list[Finding]) -> Diagnostic:
    from rlflow.pins.fix import Edit, Refusal, plan  # only when there is a finding to word

    message, help_text = _WORDS[finding.code](finding)
    fix = plan(finding, findings)
    if isinstance(fix, Edit):
        help_text = (
            f"{fix.description} at {finding.ours.location} (or run `rlflow check-pins --fix`)"
        )
    elif isinstance(fix, Refusal) and help_text is None:
        help_text = fix.reason
    where = (
        finding.ours.location
        if finding.ours
        else (finding.location or (finding.theirs[0].location if finding.theirs else None))
    )
    notes = []
    for site in finding.theirs:  # the arrow already shows `where`: never print it twice
        note = _site_note(site)
        if note not in notes and not (site.location == where and len(finding.theirs) == 1):
            notes.append(note)
    if finding.code in UV_SAYS and finding.package:
        notes.append(UV_SAYS[finding.code].format(package=finding.package))
    return Diagnostic(
        finding.code,
        message,
        finding.severity,
        file=where.file if where else None,
        line=where.line if where else None,
        column=where.column if where else None,
        help=help_text,
        notes=tuple(notes),
    )


def print_text(findings: list[Finding], allowed: list, checked: str, root, stream=None) -> None:
    stream = stream or sys.stdout
    diagnostics = [to_diagnostic(f, findings) for f in findings]
    for diagnostic in diagnostics:
        print(diagnostic.render(root), file=stream)
        print(file=stream)
    for finding, entry in allowed:
        what = f"`{finding.package}`" if finding.package else (finding.detail or "")[:80]
        print(f"allowed[{finding.code}]: {what} ({entry.reason}) -- {entry.location}", file=stream)
    tail = (
        f"{summary_line(diagnostics)} ({checked})"
        if diagnostics
        else f"ok: {checked}, no pin drift"
    )
    print(tail, file=stream)


def json_document(findings: list[Finding], allowed: list, checked: str, exit_code: int) -> dict:
    diagnostics = []
    for finding in findings:
        data = to_diagnostic(finding, findings).to_json()
        data["package"] = finding.package
        data["ours"] = _site_json(finding.ours) if finding.ours else None
        data["theirs"] = [_site_json(s) for s in finding.theirs]
        if finding.submodule:
            data["submodule"] = {
                "path": finding.submodule.path,
                "gitlink": finding.submodule.gitlink,
                "head": finding.submodule.head,
            }
        diagnostics.append(data)
    return {
        "diagnostics": diagnostics,
        "allowed": [
            {
                "code": f.code,
                "package": f.package,
                "reason": e.reason,
                "allowed_at": str(e.location),
            }
            for f, e in allowed
        ],
        "checked": checked,
        "summary": summary_line([to_diagnostic(f, findings) for f in findings]),
        "exit_code": exit_code,
    }


def print_json(document: dict, stream=None) -> None:
    import json  # only for --format json: a text check never imports it

    print(json.dumps(document, indent=2), file=stream or sys.stdout)


# -- words per code ---------------------------------------------------------------------------
def _site_note(site: Pin | IndexDef) -> str:
    if isinstance(site, IndexDef):
        return f"`{site.url}` is set at {site.location}"
    return f"`{site.display}` is set at {site.location} [{site.origin}]"


def _who(site: Pin | IndexDef) -> str:
    return "the root" if site.is_root else f"submodule `{site.project}`"


def _whose(sites) -> str:
    names = sorted({_who(s) for s in sites})
    return (
        names[0]
        if len(names) == 1
        else "submodules " + ", ".join(n.split(" ", 1)[1] for n in names)
    )


def _site_json(site: Pin | IndexDef) -> dict:
    data = {
        "file": site.location.file,
        "line": site.location.line,
        "column": site.location.column,
        "project": site.project,
        "value": site.display,
    }
    if isinstance(site, Pin):
        data.update(kind=site.kind, key=site.key, origin=site.origin)
    return data


def _value(pin: Pin) -> str:
    if pin.kind == "git":
        return f"{pin.repo}@{pin.ref}" if pin.ref else pin.repo
    return pin.display


def _pair(finding: Finding) -> tuple[str, str]:
    """(our value, their values) as short as still tells them apart."""
    ours = finding.ours
    theirs = " / ".join(sorted({_short(t, ours) for t in finding.theirs}))
    return _short(ours, finding.theirs[0]), theirs


def _same_repo(a: Pin, b: Pin) -> bool:
    return a.kind == b.kind == "git" and a.repo == b.repo and a.subdirectory == b.subdirectory


def _short(pin: Pin, versus: Pin) -> str:
    """`v0.2.0` when only the refs differ, else the full value."""
    if _same_repo(pin, versus):
        return pin.ref or "(default branch)"
    return _value(pin)


def short_value(site, versus) -> str:
    """What `rlflow bump` lists: `v0.3.0`, `==0.6.18`, or an index URL."""
    return site.url if isinstance(site, IndexDef) else _short(site, versus)


def _rf001(f: Finding):
    ours, theirs = _pair(f)
    what = "git revs" if all(_same_repo(f.ours, t) for t in f.theirs) else "URLs"
    return (
        f"conflicting {what} for `{f.package}`: {_who(f.ours)} pins `{ours}`, "
        f"{_whose(f.theirs)} pins `{theirs}`",
        None,
    )


def _rf002(f: Finding):
    pin = f.theirs[0]
    suggestion = _as_requirement(pin)
    return (
        f"`{f.package}` is pinned by URL in submodule `{pin.project}` but not at the root",
        f"add `{suggestion}` to [tool.uv] constraint-dependencies in pyproject.toml: uv "
        "rejects a transitive URL dependency unless the root declares it (or every project "
        "in between is a local path dependency), and git pins attach only to direct requirements",
    )


def _rf003(f: Finding):
    if isinstance(f.ours, IndexDef):
        theirs = " / ".join(sorted({t.url for t in f.theirs}))
        return (
            f"index `{f.ours.name}` has two URLs: {_who(f.ours)} says `{f.ours.url}`, "
            f"{_whose(f.theirs)} says `{theirs}` (uv compares index URLs verbatim: a trailing "
            "slash is a conflict)",
            None,
        )
    theirs = " / ".join(sorted({t.display for t in f.theirs}))
    return (
        f"`{f.package}` comes from index `{f.ours.display}` in {_who(f.ours)} but from "
        f"`{theirs}` in {_whose(f.theirs)}, and their URLs differ",
        None,
    )


def _rf004(f: Finding):
    theirs = " / ".join(sorted({t.display for t in f.theirs}))
    return (
        f"no version of `{f.package}` satisfies both `{f.ours.display}` ({_who(f.ours)}) and "
        f"`{theirs}` ({_whose(f.theirs)})",
        None,
    )


def _rf005(f: Finding):
    if f.ours is None:
        pin = f.theirs[0]
        return (
            f"`{f.package}` is in [tool.rlflow.pins] lockstep but the root does not pin it",
            f"pin it at the root exactly as submodule `{pin.project}` does: `{_as_requirement(pin)}`",
        )
    ours, theirs = _pair(f)
    return (
        f"`{f.package}` is in [tool.rlflow.pins] lockstep but {_who(f.ours)} pins `{ours}`, "
        f"{_whose(f.theirs)} pins `{theirs}`",
        None,
    )


def git_in_parent(sub, *args: str) -> str:
    """A git command about `sub` that works pasted at the repository root: a nested submodule
    is a path inside its parent submodule (`git add a/b` says "Pathspec is in submodule")."""
    import posixpath
    import shlex

    parent = posixpath.dirname(sub.declared_at.file)
    name = posixpath.relpath(sub.path, parent) if parent else sub.path
    where = f"-C {shlex.quote(parent)} " if parent else ""
    return f"git {where}{' '.join(args)} {shlex.quote(name)}"


def _rf006(f: Finding):
    sub = f.submodule
    update = git_in_parent(sub, "submodule", "update", "--init", "--recursive")
    return (
        f"submodule `{sub.path}` is checked out at {sub.head[:12]} but its parent records "
        f"{sub.gitlink[:12]}: the pins checked are not the ones that will be committed",
        f"check out the recorded commit (`{update}`), or record the checked-out one "
        f"(`{git_in_parent(sub, 'add')}`)",
    )


def _rf007(f: Finding):
    sub = f.submodule
    update = git_in_parent(sub, "submodule", "update", "--init", "--recursive")
    return (
        f"submodule `{sub.path}` is not initialized: its pins were not checked",
        f"run `{update}`",
    )


def _rf008(f: Finding):
    import shlex

    sub = f.submodule
    return (
        f"`{sub.path}/pyproject.toml` has uncommitted changes: the pins checked are not the "
        f"ones its commit {(sub.head or '')[:12]} records",
        f"commit them in the submodule and stage the new gitlink (`{git_in_parent(sub, 'add')}`), "
        f"or discard them (`git -C {shlex.quote(sub.path)} checkout -- pyproject.toml`)",
    )


def _rf009(f: Finding):
    return (
        f"[tool.rlflow.pins] {f.detail} matches nothing",
        "remove the entry, or check the package name (PEP 503 names: `a_b` == `a-b`)",
    )


def _rf010(f: Finding):
    return (
        f.detail,
        "lock the same version on both sides: re-lock the side that is behind (`uv lock "
        f"--upgrade-package {f.package}`), bump the submodule, or drop it from "
        "[tool.rlflow.pins] deployed-locks if it is not deployed from its own lock",
    )


def _rf014(f: Finding):
    import posixpath
    import shlex

    sub = f.submodule
    parent = posixpath.dirname(sub.declared_at.file)
    name = posixpath.relpath(sub.path, parent)
    grand = posixpath.dirname(f.detail or ".gitmodules")  # the repository that records `parent`
    where = f"-C {shlex.quote(grand)} " if grand else ""
    record = f"git {where}add {shlex.quote(posixpath.relpath(parent, grand or '.'))}"
    return (
        f"`{sub.path}` is staged at {(sub.gitlink or '')[:12]} in `{parent}` but `{parent}`'s "
        f"commit records {(sub.committed or '(none)')[:12]}: the root would record a "
        f"`{parent}` commit without it, and a fresh clone checks out the old one",
        f"commit it in the parent submodule (`git -C {shlex.quote(parent)} commit -m "
        f"'bump {name}'`), then record that commit (`{record}`); push that commit to a branch "
        f"of `{parent}`'s remote before the root's (`git -C {shlex.quote(parent)} push origin "
        "HEAD:<branch>`): a commit only your checkout has breaks every fresh clone too",
    )


def _rf013(f: Finding):
    return (
        f.detail,
        "run `uv lock --check` (it may build or fetch); allow the finding with "
        '`{ code = "RF013", reason = "..." }` if CI does, or set `lock-level = false`',
    )


def _rf011(f: Finding):
    import posixpath
    import shlex

    directory = posixpath.dirname(f.detail.split("`")[1])
    command = f"uv lock --directory {shlex.quote(directory)}" if directory else "uv lock"
    return f.detail, f"run `{command}` (then commit the lock)"


def _rf012(f: Finding):
    message, _, commands = (f.detail or "").partition("\n")
    return message, commands or _rf012_help(f)  # "cannot check": the commands that fix it


def _rf012_help(f: Finding) -> str:
    sub = f.submodule
    return (
        "push the commit to that ref of the .gitmodules URL, or move the submodule to a "
        f"commit on it (`rlflow bump {sub.path} <ref>`)"
    )


def _as_requirement(pin: Pin) -> str:
    if pin.requirement:
        return pin.requirement
    if pin.kind == "git":
        url = pin.url if pin.url.startswith("git+") else f"git+{pin.url}"
        ref = f"@{pin.ref}" if pin.ref else ""
        sub = f"#subdirectory={pin.subdirectory}" if pin.subdirectory else ""
        return f"{pin.package} @ {url}{ref}{sub}"
    return f"{pin.package} @ {pin.display}"


_WORDS = {
    "RF001": _rf001,
    "RF002": _rf002,
    "RF003": _rf003,
    "RF004": _rf004,
    "RF005": _rf005,
    "RF006": _rf006,
    "RF007": _rf007,
    "RF008": _rf008,
    "RF009": _rf009,
    "RF010": _rf010,
    "RF011": _rf011,
    "RF012": _rf012,
    "RF013": _rf013,
    "RF014": _rf014,
}
