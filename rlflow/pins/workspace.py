"""A uv workspace as uv reads it, offline: the `Project` of one pyproject.toml (its
`[tool.uv.sources]`, named indexes and `no-sources`), the workspace members that
`[tool.uv.workspace]` globs find (and the directories uv refuses), and the pyprojects check-pins
has parsed already (`reusing`), so the lock level does not parse them again. `Undecidable` is
what the lock level raises when it cannot tell offline what uv would do. Lowering the
requirements of a project is lowering.py's.
"""

from __future__ import annotations

import glob
import os
import tomllib
from contextlib import contextmanager
from pathlib import Path

from rlflow.pins import records
from rlflow.pins.pep508 import canonicalize_name


class Undecidable(Exception):
    """rlflow cannot tell offline what uv would record (dynamic metadata, a missing project)."""


@records.record(frozen=False)
class Project:
    """One local project as uv reads it."""

    directory: str  # absolute, normalized
    data: dict
    sources: dict[str, list[dict]]
    indexes: dict[str, str]
    workspace_sources: dict[str, list[dict]] = records.factory(dict)
    workspace_indexes: dict[str, str] = records.factory(dict)
    members: dict[str, str] = records.factory(dict)  # workspace member name -> directory
    no_sources: bool = False  # the workspace root's `[tool.uv] no-sources = true`

    @property
    def table(self) -> dict:
        value = self.data.get("project")
        return value if isinstance(value, dict) else {}

    @property
    def uv(self) -> dict:
        tool = self.data.get("tool")
        value = tool.get("uv") if isinstance(tool, dict) else None
        return value if isinstance(value, dict) else {}

    @property
    def name(self) -> str | None:
        name = self.table.get("name")
        return canonicalize_name(name) if isinstance(name, str) else None


# Pyprojects the caller has parsed already (directory -> data, set by `reusing`): check-pins
# read every submodule's pyproject before the lock level, which would parse them again.
_PARSED: dict[str, dict] = {}


@contextmanager
def reusing(parsed: dict[str, dict]):
    _PARSED.update({os.path.normpath(k): v for k, v in parsed.items()})
    try:
        yield
    finally:
        _PARSED.clear()


def load_project(directory: str) -> Project:
    data = _PARSED.get(os.path.normpath(directory))
    if data is not None:
        return project_from(directory, data)
    path = Path(directory) / "pyproject.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8").removeprefix("\ufeff"))
    except FileNotFoundError:
        raise Undecidable(f"`{directory}` has no pyproject.toml (not checked out?)") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise Undecidable(f"cannot read `{path}`: {err}") from None
    return project_from(directory, data)


def project_from(directory: str, data: dict) -> Project:
    project = Project(os.path.normpath(directory), data, {}, {})
    project.no_sources = project.uv.get("no-sources") is True
    sources = project.uv.get("sources", {})
    if isinstance(sources, dict):
        for name, value in sources.items():
            items = value if isinstance(value, list) else [value]
            project.sources[canonicalize_name(name)] = [s for s in items if isinstance(s, dict)]
    for entry in project.uv.get("index", []) if isinstance(project.uv.get("index"), list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            project.indexes[entry["name"]] = str(entry.get("url", ""))
    return project


def workspace_members(root: Project) -> dict[str, Project]:
    """Name -> member project (the root included when it has a [project] table)."""
    members: dict[str, Project] = {}
    if root.name:
        members[root.name] = root
    table = root.uv.get("workspace")
    if not isinstance(table, dict):
        return members
    excluded = set()
    for pattern in table.get("exclude", []) or []:
        excluded |= {os.path.normpath(p) for p in glob.glob(os.path.join(root.directory, pattern))}
    for pattern in table.get("members", []) or []:
        for directory in sorted(glob.glob(os.path.join(root.directory, str(pattern)))):
            directory = os.path.normpath(directory)
            if directory in excluded or not os.path.isdir(directory):
                continue
            if not os.path.isfile(os.path.join(directory, "pyproject.toml")):
                # uv skips a directory with only gitignored files (an empty one: a submodule not
                # checked out) and refuses the workspace otherwise (`uv lock --check` exits 2)
                if not os.listdir(directory):
                    continue
                raise Undecidable(
                    f"`{directory}` matches [tool.uv.workspace] members `{pattern}` but has no "
                    "pyproject.toml: uv refuses the workspace unless every file in it is "
                    "gitignored (add it to `exclude`)"
                )
            member = load_project(directory)
            if member.name:
                members[member.name] = member
    for member in members.values():
        member.workspace_sources = root.sources
        member.workspace_indexes = root.indexes
        member.no_sources = root.no_sources
        member.members = {name: m.directory for name, m in members.items()}
    return members
