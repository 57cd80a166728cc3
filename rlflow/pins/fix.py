"""`--fix`: move root pins to the submodules' values, or say why not.

Planning is pure and cheap (report.py uses it to write each finding's help line); applying
loads tomlkit, which keeps comments and layout. Only the root pyproject.toml is edited, in
one atomic replace, and only when every pin finding has exactly one right value: if two
submodules disagree, or a submodule allows a range where the root pins one version, nothing
is written and the reasons are printed (exit 1).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement
from packaging.requirements import Requirement as Pep508

from rlflow.pins.model import Finding, IndexDef, Pin
from rlflow.pins.versions import exact_version

FIXABLE_CODES = ("RF001", "RF003", "RF004", "RF005")
_COMMIT = re.compile(r"[0-9a-f]{7,40}")
_BOM = "\ufeff"
_REQUIREMENT_HEAD = re.compile(
    r"^(?P<head>\s*[A-Za-z0-9][A-Za-z0-9._-]*\s*(\[[^\]]*\])?\s*)"
    r"(?P<spec>[^;]*?)(?P<tail>\s*(;.*)?)$",
    re.DOTALL,
)


@dataclass(frozen=True)
class Change:
    """Set `path` to `value` (delete it when None), renaming its key to `rename_to` if given."""

    path: tuple[str | int, ...]
    value: str | None
    rename_to: str | None = None


@dataclass(frozen=True)
class Edit:
    changes: tuple[Change, ...]
    description: str  # `set rev = "v0.3.0"`: what the help line tells a human to do


@dataclass(frozen=True)
class Refusal:
    reason: str


def plan(finding: Finding, findings: list[Finding]) -> Edit | Refusal | None:
    """The edit that resolves `finding`, a Refusal saying why there is no single one, or None
    for findings that are not about a root pin (submodule state, policy)."""
    if finding.code not in FIXABLE_CODES:
        return None
    ours, theirs = finding.ours, finding.theirs
    if ours is None:
        return Refusal(f"the root does not pin `{finding.package}`: add the pin by hand")
    if not ours.is_root or any(t.is_root for t in theirs):
        return Refusal(
            "the submodules disagree with each other (or two root pins do): bump a "
            "submodule, or force one value with the root's override-dependencies"
        )
    if len({_target_key(t) for t in theirs}) > 1:
        values = ", ".join(f"`{t.display}` ({t.location})" for t in theirs)
        return Refusal(
            f"the submodules pin different values ({values}): which one is right "
            "is a decision, not a fix"
        )
    if any(
        f.package == finding.package
        and f.code == finding.code
        and f.ours is not None
        and not f.ours.is_root
        for f in findings
    ):
        return Refusal(f"the submodules disagree about `{finding.package}` among themselves")
    if isinstance(ours, IndexDef):
        return Edit((Change(ours.doc_path, theirs[0].url),), f'set url = "{theirs[0].url}"')
    return _pin_edit(finding.code, ours, theirs[0])


def _target_key(site) -> str:
    return site.url if isinstance(site, IndexDef) else site.key


def _pin_edit(code: str, ours: Pin, target: Pin) -> Edit | Refusal:
    if ours.kind == "version" and target.kind == "version":
        return _version_edit(code, ours, target)
    if ours.kind == "git" and target.kind == "git":
        return _git_edit(ours, target)
    if ours.kind == target.kind == "url" and ours.requirement:
        return _requirement_edit(ours, ours.requirement.replace(ours.url, target.url, 1))
    return Refusal(
        f"the root uses a {ours.kind} source and the submodule a {target.kind} "
        "source: change the kind of source by hand"
    )


def _version_edit(code: str, ours: Pin, target: Pin) -> Edit | Refusal:
    version = exact_version(target.key)
    if version is None and code == "RF004":
        return Refusal(
            f"the submodule allows a range (`{target.display}`), not one version: "
            "pick the version by hand"
        )
    spec = f"=={version}" if version else target.display
    if ours.origin == "tool.uv.dependency-metadata":
        if version is None:
            return Refusal("dependency-metadata needs one exact version")
        return Edit((Change(ours.doc_path, version),), f'set version = "{version}"')
    match = _REQUIREMENT_HEAD.match(ours.requirement or "")
    if not match:
        return Refusal(f"cannot rewrite the requirement `{ours.requirement}`")
    return _requirement_edit(ours, f"{match.group('head')}{spec}{match.group('tail')}")


def _git_edit(ours: Pin, target: Pin) -> Edit | Refusal:
    if ours.origin == "tool.uv.sources":
        return _git_source_edit(ours, target)
    if ours.repo == target.repo:
        base = _without_ref(ours.url, ours.ref)
    else:
        base = "git+" + _strip_git_prefix(_without_ref(target.url, target.ref))
    new_url = base + (f"@{target.ref}" if target.ref else "")
    if target.subdirectory:
        new_url += f"#subdirectory={target.subdirectory}"
    return _requirement_edit(ours, ours.requirement.replace(ours.url, new_url, 1))


def _git_source_edit(ours: Pin, target: Pin) -> Edit:
    table, changes, words = ours.doc_path, [], []
    if ours.repo != target.repo:
        url = _strip_git_prefix(_without_ref(target.url, target.ref))
        changes.append(Change(table + ("git",), url))
        words.append(f'git = "{url}"')
    # Keep the root's key (a `tag` stays a `tag`); only a commit hash cannot be a tag or branch.
    key = ours.ref_key or target.ref_key or "rev"
    if key != "rev" and target.ref and _COMMIT.fullmatch(target.ref):
        key = "rev"
    if ours.ref_key and not target.ref:
        changes.append(Change(table + (ours.ref_key,), None))
        words.append(f"remove `{ours.ref_key}`")
    elif ours.ref_key and ours.ref_key != key:
        changes.append(Change(table + (ours.ref_key,), target.ref, rename_to=key))
        words.append(f'{key} = "{target.ref}" (instead of `{ours.ref_key}`: a commit)')
    elif target.ref:
        changes.append(Change(table + (key,), target.ref))
        words.append(f'{key} = "{target.ref}"')
    if ours.subdirectory != target.subdirectory:
        changes.append(Change(table + ("subdirectory",), target.subdirectory))
        words.append(
            f'subdirectory = "{target.subdirectory}"'
            if target.subdirectory
            else "remove `subdirectory`"
        )
    return Edit(tuple(changes), "set " + ", ".join(words))


def _without_ref(url: str, ref: str | None) -> str:
    url = url.split("#", 1)[0]
    return url[: -len(ref) - 1] if ref and url.endswith("@" + ref) else url


def _requirement_edit(ours: Pin, new: str) -> Edit | Refusal:
    try:
        Pep508(new)
    except InvalidRequirement:
        return Refusal(f"cannot rewrite the requirement `{ours.requirement}` safely")
    return Edit((Change(ours.doc_path, new),), f'set the requirement to "{new}"')


def _strip_git_prefix(url: str) -> str:
    return url[len("git+") :] if url.startswith("git+") else url


# -- applying ---------------------------------------------------------------------------------
def apply(text: str, edits: list[Edit]) -> str:
    """The root pyproject text with every edit made by tomlkit (comments and layout kept)."""
    import tomlkit  # only --fix pays for it

    bom = _BOM if text.startswith(_BOM) else ""
    doc = tomlkit.parse(text.removeprefix(bom))
    for edit in edits:
        for change in edit.changes:
            _apply_change(tomlkit, doc, change)
    new = tomlkit.dumps(doc)
    if "\r\n" in text and text.count("\n") == text.count("\r\n"):  # a CRLF file stays CRLF
        new = new.replace("\r\n", "\n").replace("\n", "\r\n")
    return bom + new


def _apply_change(tomlkit, doc, change: Change) -> None:
    *parents, key = change.path
    container = doc
    for part in parents:
        container = container[part]
    if change.value is None:
        if key in container:
            del container[key]
    elif change.rename_to is None:
        old = container[key] if isinstance(key, int) or key in container else None
        container[key] = _string_like(tomlkit, old, change.value)
    elif isinstance(container, tomlkit.items.InlineTable):
        _rename_inline(tomlkit, doc, change)
    else:
        del container[key]
        container[change.rename_to] = change.value


def _rename_inline(tomlkit, doc, change: Change) -> None:
    """Rename a key inside a one-line inline table without touching the rest of its spelling
    (tomlkit can only delete and append, which leaves stray spaces behind)."""
    *grand, name, key = change.path
    parent = doc
    for part in grand:
        parent = parent[part]
    table = parent[name]
    pattern = re.compile(rf"(?<![\w-]){re.escape(key)}(\s*=\s*)(\"(?:[^\"\\]|\\.)*\"|'[^']*')")
    value = tomlkit.string(change.value).as_string()
    text, count = pattern.subn(
        lambda m: f"{change.rename_to}{m.group(1)}{value}", table.as_string(), 1
    )
    assert count == 1, f"{key} not found in {table.as_string()}"  # we located it while parsing
    item = tomlkit.parse(f"x = {text}")["x"]
    item.trivia.comment_ws, item.trivia.comment = table.trivia.comment_ws, table.trivia.comment
    parent[name] = item


def _string_like(tomlkit, old, value: str):
    """A string in the old value's quoting style ('literal' stays literal)."""
    literal = getattr(getattr(old, "type", None), "name", "") in ("SLL", "MLL")
    return tomlkit.string(value, literal=literal and "'" not in value)


def unified_diff(old: str, new: str, rel_file: str) -> str:
    import difflib  # ~10-30 ms: only --fix needs it

    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            fromfile=f"a/{rel_file}",
            tofile=f"b/{rel_file}",
        )
    )


def write_atomically(path: Path, new: str, expected_old: str) -> None:
    """Replace `path` with `new` in one rename; refuse if it changed since it was read."""
    import tempfile

    from rlflow.pins.parse import read_toml_text

    if read_toml_text(path) != expected_old:
        raise OSError(f"{path} changed while check-pins was fixing it; run it again")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as out:
            out.write(new)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
