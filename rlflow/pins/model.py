"""The data check-pins passes between its steps: types only, no behaviour beyond formatting."""

from __future__ import annotations

from pathlib import Path

from rlflow.pins import records
from rlflow.pins.records import factory, record

_set = object.__setattr__

# The root scope that is always installed ("" sorts first and never conflicts with anything).
ALWAYS = ""


class Location:
    """A place in a file: path relative to the repository root ("/"-separated), 1-based.

    `Location.lazy(file, find)` leaves the line and column to `find() -> (line, column)`, called
    the first time either is read: every requirement has a location, and only the few that a
    finding reports are ever read (finding them lexes the file). A frozen value like a record.
    """

    __slots__ = ("file", "_place", "_find")
    __record_fields__ = __match_args__ = ("file", "line", "column")

    def __init__(self, file: str, line: int | None = None, column: int | None = None):
        _set(self, "file", file)
        _set(self, "_place", (line, column))
        _set(self, "_find", None)

    @classmethod
    def lazy(cls, file: str, find) -> Location:
        where = cls(file)
        _set(where, "_find", find)
        return where

    @property
    def line(self) -> int | None:
        return self._resolved()[0]

    @property
    def column(self) -> int | None:
        return self._resolved()[1]

    def _resolved(self) -> tuple[int | None, int | None]:
        if self._find is not None:
            _set(self, "_place", tuple(self._find()))
            _set(self, "_find", None)
        return self._place

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file

    def __reduce__(self):  # pickle and copy: through __init__ (assignment is refused)
        return (Location, (self.file, self.line, self.column))

    __repr__, __eq__, __hash__ = records.record_repr, records.record_eq, records.record_hash
    __setattr__ = __delattr__ = records.refuse_assignment


@record
class Pin:
    """One statement that fixes where or which version a package comes from.

    kind: "git" | "url" | "path" (compared as URLs, like uv does), "index", or "version".
    key: the normalized value that is compared; display: the value as a human wrote it.
    doc_path: where the value lives in the TOML document (what `--fix` edits).
    reach: the root scopes ("" = always, "extra:x", "group:y") under which uv installs it.
    """

    package: str
    kind: str
    key: str
    display: str
    origin: str
    location: Location
    project: str
    doc_path: tuple[str | int, ...]
    marker: str | None = None
    requirement: str | None = None  # the requirement string as written (requirement pins)
    url: str | None = None  # the URL as written (git/url pins)
    repo: str | None = None  # git: normalized repository URL, without the ref
    ref_key: str | None = None  # git sources: "rev" | "tag" | "branch"
    ref: str | None = None  # git: the rev, tag or branch
    subdirectory: str | None = None
    reach: frozenset[str] = frozenset({ALWAYS})

    @property
    def is_root(self) -> bool:
        return self.project == ""


@record
class Requirement:
    """A PEP 508 requirement in one scope of a project ("dependencies", "extra:x", "group:y",
    "constraint", "override"); `pin` is its version or URL pin, if it has one."""

    package: str
    extras: frozenset[str]
    scope: str
    pin: Pin | None


@record
class IndexDef:
    """A `[[tool.uv.index]]` entry: name -> URL (uv compares URLs verbatim: a trailing slash counts)."""

    name: str
    url: str
    location: Location
    project: str
    doc_path: tuple[str | int, ...]

    @property
    def display(self) -> str:
        return self.url

    @property
    def is_root(self) -> bool:
        return self.project == ""


@record
class Manifest:
    """What check-pins reads from one pyproject.toml."""

    project: str  # directory relative to the repository root; "" for the root
    file: str  # the pyproject.toml, relative to the repository root
    name: str | None
    version_pin: Pin | None  # a submodule's own static [project].version, as `name==version`
    requirements: tuple[Requirement, ...]
    sources: tuple[tuple[Pin, str | None], ...]  # (source pin, the scope it is limited to)
    indexes: tuple[IndexDef, ...]
    metadata_pins: tuple[Pin, ...]  # [[tool.uv.dependency-metadata]] versions (root only)
    conflicts: tuple[frozenset[str], ...]  # [tool.uv] conflicts, as scope sets (root only)
    directory: str = ""  # absolute directory of the project (path pins resolve against it)


@record
class Submodule:
    """A submodule as git sees it: where it is declared, what the parent records, what is there."""

    path: str  # relative to the repository root
    declared_at: Location  # the `path = ...` line in the parent's .gitmodules
    gitlink: str | None  # commit recorded in the parent's index; None if not recorded
    head: str | None  # commit checked out; None if not initialized
    pyproject_dirty: bool = False
    url: str | None = None  # the parent's .gitmodules `url =`
    committed: str | None = None  # nested only: the gitlink its parent's HEAD records

    @property
    def initialized(self) -> bool:
        return self.head is not None


@record
class Checkout:
    """The repository and every initialized submodule that has a pyproject.toml."""

    root: Path
    pyprojects: tuple[str, ...]  # project directories relative to root, root ("") first
    submodules: tuple[Submodule, ...] = factory(tuple)


@record
class Finding:
    """One problem. `ours` is what to edit (the root side, when there is one); `theirs` the
    value(s) it disagrees with. compare.py fills the data, report.py writes the words."""

    code: str
    severity: str
    package: str | None = None
    ours: Pin | IndexDef | None = None
    theirs: tuple[Pin | IndexDef, ...] = ()
    submodule: Submodule | None = None
    detail: str | None = None  # code-specific extra text (e.g. the stale policy entry)
    location: Location | None = None  # where to point when there is no `ours`

    @property
    def projects(self) -> tuple[str, ...]:
        sites = ([self.ours] if self.ours else []) + list(self.theirs)
        return tuple(s.project for s in sites)
