"""One pyproject.toml -> the pins uv acts on, each with the file:line:column that sets it.

Values come from tomllib (fast, strict); positions from `lines.TomlLines`. Anything check-pins
cannot read (malformed TOML, a requirement that is not PEP 508, a source with a number where a
string belongs) is unusable input: an `RlflowError` naming the file, line and key (exit 2).

Only the tables uv honours are read. For the root: dependencies, every extra and group,
constraint-dependencies, override-dependencies, sources, indexes, dependency-metadata and
conflicts. For a submodule: dependencies, extras, sources, indexes and its static version;
uv ignores a dependency's groups and its `[tool.uv]` constraints and overrides, so we do too.
"""

from __future__ import annotations

import os
import re
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from rlflow.errors import Diagnostic, RlflowError
from rlflow.pins import pep508
from rlflow.pins.lines import TomlLines
from rlflow.pins.model import IndexDef, Location, Manifest, Pin, Requirement
from rlflow.pins.pep508 import canonicalize_name
from rlflow.pins.records import record
from rlflow.pins.urls import git_key, normalize_repo, parse_direct_url, path_key

_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$|\s*\(at end of document\)$")
_GIT_REFS = ("rev", "tag", "branch")
BOM = "\ufeff"


@record
class Document:
    """A parsed TOML file that can say where each key is."""

    file: str  # relative to the repository root
    data: dict
    lines: TomlLines

    def loc(self, path: tuple, needle: re.Pattern | None = None) -> Location:
        """Where `path` is set (found when first read: model.Location.lazy)."""
        return Location.lazy(self.file, lambda: self.lines.locate(path, needle))

    def item_loc(self, path: tuple, count: int, text: str) -> Location:
        """Where the string `text`, item `path[-1]` of a `count`-item array, is written."""
        return Location.lazy(self.file, lambda: self._item_place(path, count, text))

    def _item_place(self, path: tuple, count: int, text: str) -> tuple:
        found = self.lines.item(path, count)
        if found is None:  # an array inside an inline table: search its line(s) for the text
            needle = re.compile(r"[\"']\s*(?P<at>)" + re.escape(text.strip()[:60]))
            return self.lines.locate(path, needle)
        return found

    def bad_value(self, path: tuple, message: str, help: str | None = None) -> RlflowError:
        key = ".".join(str(p) for p in path)
        return bad_at(self.loc(path), f"{message} (at `{key}`)", help)


def bad_at(where: Location, message: str, help: str | None) -> RlflowError:  # noqa: A002
    """A value in a pyproject.toml that check-pins cannot use (RF103), at `where`."""
    return RlflowError(
        Diagnostic(
            "RF103", message, file=where.file, line=where.line, column=where.column, help=help
        )
    )


def load_document(root: Path, rel_file: str) -> Document:
    """Read and parse `root/rel_file`; missing, unreadable or malformed -> exit 2."""
    try:
        text = read_toml_text(root / rel_file)
    except FileNotFoundError:
        raise RlflowError(
            Diagnostic(
                "RF101",
                f"no pyproject.toml at `{rel_file}`",
                file=rel_file,
                help="run check-pins at the root of a uv project",
                category="pins-unchecked",  # nothing to compare: not a finding
            )
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise RlflowError(
            Diagnostic("RF102", f"cannot read `{rel_file}`: {err}", file=rel_file)
        ) from None
    return parse_document(rel_file, text)


def read_toml_text(path: Path) -> str:
    """The file's text exactly as written: CRLF kept (`--fix` writes it back), BOM kept."""
    with open(path, encoding="utf-8", newline="") as stream:
        return stream.read()


def parse_document(rel_file: str, text: str) -> Document:
    text = text.removeprefix(BOM)  # uv reads a UTF-8 BOM as nothing; so do we
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise _toml_error(rel_file, text, err) from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise _too_deep(rel_file, text) from None
    return Document(rel_file, data, TomlLines(text))


def _too_deep(rel_file: str, text: str) -> RlflowError:
    line = TomlLines.deepest_line(text)
    return RlflowError(
        Diagnostic(
            "RF102",
            "malformed TOML: arrays or inline tables nested too deeply to read",
            file=rel_file,
            line=line,
            help="no pyproject.toml needs this much nesting: look for a run of `[` or `{`",
        )
    )


def _toml_error(rel_file: str, text: str, err: tomllib.TOMLDecodeError) -> RlflowError:
    message = str(err)
    match = _TOML_POSITION.search(message)
    line = column = None
    if match and match.group(1):
        line, column = int(match.group(1)), int(match.group(2))
    elif match:
        line = max(len(text.splitlines()), 1)
    reason = _TOML_POSITION.sub("", message) or "invalid TOML"
    return RlflowError(
        Diagnostic(
            "RF102",
            f"malformed TOML: {reason[:1].lower()}{reason[1:]}",
            file=rel_file,
            line=line,
            column=column,
            help="fix the TOML syntax; `python -m tomllib` style parsers "
            "(and uv) reject this file too",
        )
    )


def read_manifest(doc: Document, project: str, abs_dir: Path, is_root: bool) -> Manifest:
    reader = _Reader(doc, project, str(abs_dir), is_root)
    return reader.manifest()


class _Reader:
    def __init__(self, doc: Document, project: str, abs_dir: str, is_root: bool):
        self.doc, self.project, self.abs_dir, self.is_root = doc, project, abs_dir, is_root

    def manifest(self) -> Manifest:
        name = self.get(("project", "name"), str, None)
        indexes = _indexes(self)
        urls = {i.name: i.url for i in indexes}
        return Manifest(
            project=self.project,
            file=self.doc.file,
            name=canonicalize_name(name) if name else None,
            version_pin=None if self.is_root else _version_pin(self, name),
            requirements=tuple(self.requirements()),
            sources=tuple(_sources(self, urls)),
            indexes=tuple(indexes),
            metadata_pins=tuple(_metadata_pins(self)) if self.is_root else (),
            conflicts=tuple(_conflicts(self)) if self.is_root else (),
            directory=os.path.normpath(self.abs_dir),
        )

    # -- typed access ---------------------------------------------------------------------
    def get(self, path: tuple, kind: type | tuple[type, ...], default: Any) -> Any:
        value: Any = self.doc.data
        for i, key in enumerate(path):
            if not isinstance(value, dict):
                raise self.doc.bad_value(path[:i], f"expected a table, found {_type_name(value)}")
            if key not in value:
                return default
            value = value[key]
        return self.check(value, kind, path)

    def check(self, value: Any, kind: type | tuple[type, ...], path: tuple) -> Any:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.doc.bad_value(
                path, f"expected {_type_name(kind)}, found {_type_name(value)}"
            )
        return value

    # -- requirements ---------------------------------------------------------------------
    def requirement_lists(self):
        yield ("project", "dependencies"), "dependencies"
        for extra in self.get(("project", "optional-dependencies"), dict, {}):
            yield ("project", "optional-dependencies", extra), f"extra:{canonicalize_name(extra)}"
        if not self.is_root:
            return  # uv never installs a dependency's groups, constraints or overrides
        for group in self.get(("dependency-groups",), dict, {}):
            yield ("dependency-groups", group), f"group:{canonicalize_name(group)}"
        yield ("tool", "uv", "dev-dependencies"), "group:dev"
        yield ("tool", "uv", "constraint-dependencies"), "constraint"
        yield ("tool", "uv", "override-dependencies"), "override"

    def requirements(self) -> list[Requirement]:
        out = []
        for path, scope in self.requirement_lists():
            items = self.get(path, list, [])
            for i, item in enumerate(items):
                if (
                    scope.startswith("group:")
                    and isinstance(item, dict)
                    and "include-group" in item
                ):
                    continue  # `{include-group = "x"}`: x's requirements are read on their own
                text = self.check(item, str, path + (i,))
                location = self.doc.item_loc(path + (i,), len(items), text)
                out.append(self.requirement(text, path + (i,), scope, location))
        return out

    def requirement(self, text: str, path: tuple, scope: str, where: Location) -> Requirement:
        try:
            parsed = pep508.parse(text)
        except pep508.InvalidRequirement as err:
            fix = "write it as PEP 508: `name[extras] (specifiers) ; markers` or `name @ URL`"
            raise bad_at(where, f"`{text}` is not a valid requirement: {err}", fix) from None
        package = canonicalize_name(parsed.name)
        pin = self.requirement_pin(parsed, package, text, path, where)
        return Requirement(
            package, frozenset(canonicalize_name(e) for e in parsed.extras), scope, pin
        )

    def requirement_pin(
        self, parsed: pep508.Parsed, package: str, text: str, path: tuple, location: Location
    ) -> Pin | None:
        origin = _origin(path[:-1] if isinstance(path[-1], int) else path)
        common = dict(
            package=package,
            origin=origin,
            location=location,
            project=self.project,
            doc_path=path,
            marker=str(parsed.marker) if parsed.marker else None,
            requirement=text,
        )
        if parsed.url:
            url = self.url(parse_direct_url, path, parsed.url, self.abs_dir)
            return Pin(
                kind=url.kind,
                key=url.key,
                display=parsed.url,
                url=parsed.url,
                repo=url.repo,
                ref=url.ref,
                subdirectory=url.subdirectory,
                **common,
            )
        if len(parsed.specifier):
            key, display = pep508.spec_words(parsed)
            return Pin(kind="version", key=key, display=display, **common)
        return None

    def url(self, parse, path: tuple, text: str, *args):
        """`parse(text)`, or exit 2 naming the key when the URL cannot be parsed at all."""
        try:
            return parse(text, *args)
        except ValueError as err:
            raise self.doc.bad_value(path, f"`{text[:200]}` is not a valid URL: {err}") from None


# -- [tool.uv.sources] (functions of a _Reader) ----------------------------------------------------------------
def _sources(reader, index_urls: dict[str, str]) -> list[tuple[Pin, str | None]]:
    out = []
    for raw_name, value in reader.get(("tool", "uv", "sources"), dict, {}).items():
        base = ("tool", "uv", "sources", raw_name)
        entries = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, source in entries:
            path = base if i is None else base + (i,)
            source = reader.check(source, dict, path)
            pin = _source_pin(reader, canonicalize_name(raw_name), source, path, index_urls)
            if pin is not None:
                out.append((pin, _source_scope(reader, source, path)))
    return out


def _source_scope(reader, source: dict, path: tuple) -> str | None:
    if "extra" in source:
        return f"extra:{canonicalize_name(reader.check(source['extra'], str, path + ('extra',)))}"
    if "group" in source:
        return f"group:{canonicalize_name(reader.check(source['group'], str, path + ('group',)))}"
    return None


def _source_pin(
    reader, package: str, source: dict, path: tuple, index_urls: dict[str, str]
) -> Pin | None:
    for key in ("git", "url", "path", "index", "subdirectory", "marker", *_GIT_REFS):
        if key in source:
            reader.check(source[key], str, path + (key,))
    marker = source.get("marker")
    common = dict(
        package=package,
        origin="tool.uv.sources",
        project=reader.project,
        doc_path=path,
        marker=marker,
    )
    if "git" in source:
        return _git_source(reader, source, path, common)
    if "url" in source:
        url = reader.url(parse_direct_url, path + ("url",), source["url"], reader.abs_dir)
        return Pin(
            kind=url.kind,
            key=url.key,
            display=source["url"],
            url=source["url"],
            location=_value_loc(reader, path, "url"),
            **common,
        )
    if "path" in source:
        return Pin(
            kind="path",
            key=path_key(source["path"], reader.abs_dir),
            display=source["path"],
            location=_value_loc(reader, path, "path"),
            **common,
        )
    if "index" in source:
        name = source["index"]
        key = f"index:{index_urls[name]}" if name in index_urls else f"index-name:{name}"
        return Pin(
            kind="index",
            key=key,
            display=name,
            location=_value_loc(reader, path, "index"),
            **common,
        )
    if "workspace" in source:
        return None  # a workspace member is built from this checkout: nothing to drift
    raise reader.doc.bad_value(
        path, "a source needs one of `git`, `url`, `path`, `index` or `workspace`"
    )


def _git_source(reader, source: dict, path: tuple, common: dict) -> Pin:
    refs = [k for k in _GIT_REFS if k in source]
    if len(refs) > 1:
        raise reader.doc.bad_value(
            path, f"a git source takes one of rev, tag or branch, not {' and '.join(refs)}"
        )
    ref_key = refs[0] if refs else None
    ref = source[ref_key] if ref_key else None
    repo = reader.url(normalize_repo, path + ("git",), source["git"])
    subdirectory = source.get("subdirectory")
    return Pin(
        kind="git",
        key=git_key(repo, ref, subdirectory),
        display=ref or source["git"],
        url=source["git"],
        repo=repo,
        ref_key=ref_key,
        ref=ref,
        subdirectory=subdirectory,
        location=_value_loc(reader, path, ref_key or "git"),
        **common,
    )


def _value_loc(reader, path: tuple, key: str) -> Location:
    """The value of `key` inside the source at `path` (inline table or [table] form)."""
    needle = re.compile(rf"\b{re.escape(key)}\s*=\s*(?P<at>)")
    if key not in ("url", "git"):
        return reader.doc.loc(path + (key,), needle)
    lines = reader.doc.lines  # a caret under `"https` helps nobody: underline the line
    return Location.lazy(reader.doc.file, lambda: (lines.locate(path + (key,), needle)[0], None))


# -- indexes, metadata, versions, conflicts -------------------------------------------
def _indexes(reader) -> list[IndexDef]:
    out = []
    for i, entry in enumerate(reader.get(("tool", "uv", "index"), list, [])):
        path = ("tool", "uv", "index", i)
        entry = reader.check(entry, dict, path)
        name = reader.check(entry["name"], str, path + ("name",)) if "name" in entry else None
        if "url" not in entry:
            raise reader.doc.bad_value(path, "an index needs a `url`")
        url = reader.check(entry["url"], str, path + ("url",))
        if name:
            out.append(
                IndexDef(
                    name, url, _value_loc(reader, path, "url"), reader.project, path + ("url",)
                )
            )
    return out


def _metadata_pins(reader) -> list[Pin]:
    out = []
    for i, entry in enumerate(reader.get(("tool", "uv", "dependency-metadata"), list, [])):
        path = ("tool", "uv", "dependency-metadata", i)
        entry = reader.check(entry, dict, path)
        if "name" not in entry or "version" not in entry:
            continue
        name = reader.check(entry["name"], str, path + ("name",))
        version = reader.check(entry["version"], str, path + ("version",))
        out.append(
            _exact_pin(reader, name, version, path + ("version",), "tool.uv.dependency-metadata")
        )
    return out


def _version_pin(reader, name: str | None) -> Pin | None:
    version = reader.get(("project", "version"), str, None)
    if not name or version is None:
        return None  # dynamic versions are computed at build time: nothing to compare
    return _exact_pin(reader, name, version, ("project", "version"), "project.version")


def _exact_pin(reader, name: str, version: str, path: tuple, origin: str) -> Pin:
    try:
        spec = SpecifierSet(f"=={version}")
    except InvalidSpecifier:
        raise reader.doc.bad_value(path, f"`{version}` is not a valid version") from None
    return Pin(
        package=canonicalize_name(name),
        kind="version",
        key=_spec_key(spec),
        display=str(spec),
        origin=origin,
        project=reader.project,
        doc_path=path,
        location=reader.doc.loc(path, re.compile(r"=\s*(?P<at>)")),
    )


def _conflicts(reader) -> list[frozenset[str]]:
    out = []
    for i, group in enumerate(reader.get(("tool", "uv", "conflicts"), list, [])):
        items = reader.check(group, list, ("tool", "uv", "conflicts", i))
        scopes = set()
        for j, item in enumerate(items):
            item = reader.check(item, dict, ("tool", "uv", "conflicts", i, j))
            if "extra" in item and isinstance(item["extra"], str):
                scopes.add(f"extra:{canonicalize_name(item['extra'])}")
            elif "group" in item and isinstance(item["group"], str):
                scopes.add(f"group:{canonicalize_name(item['group'])}")
        out.append(frozenset(scopes))
    return out


def _spec_key(spec: SpecifierSet) -> str:
    return ",".join(sorted(str(s) for s in spec))


@cache
def _origin(path: tuple) -> str:
    """("project", "optional-dependencies", "dev", 3) -> "project.optional-dependencies.dev"."""
    return ".".join(str(p) for p in path if not isinstance(p, int))


def _type_name(value: Any) -> str:
    names = {
        str: "a string",
        list: "an array",
        dict: "a table",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }
    if isinstance(value, type):
        return names.get(value, value.__name__)
    if isinstance(value, tuple):
        return " or ".join(_type_name(v) for v in value)
    return names.get(type(value), type(value).__name__)
