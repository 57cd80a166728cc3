"""Recipe YAML -> a tree of dicts, lists and `Scalar`s that keep the characters written.

Only PyYAML's parser is used, never its resolver: YAML 1.1 would turn `12:00:00` into 43200 and
`010` into 8 before anyone knew the field wants a string. Here a scalar stays text (with a note
of whether it was quoted); `rlflow.recipe.scalars` reads it once the schema says which type the
key has. Refused with a diagnostic, because a recipe never needs them and they can exhaust
memory or the stack: aliases, tags other than `!!str`, nesting deeper than MAX_DEPTH, files
larger than MAX_BYTES, more than one document.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from rlflow.errors import Diagnostic, RlflowError
from rlflow.frozen import frozen

MAX_DEPTH = 32  # recipes nest 4 deep; 5,000 would overflow the stack of any recursive reader
MAX_BYTES = 1 << 20
_STR_TAG = "tag:yaml.org,2002:str"
_COMMENT_HELP = (
    "inside [...], {...} or after a quoted value, YAML reads ` #` as the start of a comment: "
    "quote the items that hold `#`, e.g. key=['#a', b]"
)

KeyPath = tuple[str, ...]


@frozen
class Origin:
    """Where a value was set: a file position or a command-line override."""

    file: str
    line: int | None = None
    column: int | None = None

    def describe(self) -> str:
        if self.line is None:
            return self.file
        return f"{self.file}:{self.line}:{self.column}"

    @property
    def is_command_line(self) -> bool:
        return self.file.startswith("command line")


@frozen
class Scalar:
    """A scalar as written. `plain` (unquoted) scalars mean null/true/a number/text depending on
    the key's type; quoted ones (and `!!str`) are always text."""

    text: str
    plain: bool
    origin: Origin | None = None

    def __repr__(self) -> str:  # what diagnostics show: the value as written
        return self.text if self.plain else repr(self.text)


def diagnostic(
    code: str,
    message: str,
    origin: Origin | None,
    help: str | None = None,
    severity: str = "error",
) -> Diagnostic:
    return Diagnostic(
        code=code,
        message=message,
        severity=severity,
        file=origin.file if origin else None,
        line=origin.line if origin else None,
        column=origin.column if origin else None,
        help=help,
    )


def read_tree(text: str, file: str) -> tuple[Any, dict[KeyPath, Origin]]:
    """A recipe file's text -> (tree, origin of every mapping key). Raises RlflowError."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise RlflowError(
            diagnostic(
                "recipe.too-large",
                f"the recipe is larger than {MAX_BYTES // 1024} KiB",
                Origin(file),
                "a recipe lists settings; data belongs in files it names (data.train.path)",
            )
        )

    def at(mark) -> Origin:
        return Origin(file, mark.line + 1, mark.column + 1)

    tree, origins, _ = _build(text, at, Origin(file))
    return tree, origins


def read_value(text: str, origin: Origin, text_key: bool = False) -> Any:
    """The value of a command-line override (`key=VALUE`).

    A value that starts like a quoted scalar (`"`, `'`) or a YAML list (`[`) is read as YAML, and
    so is a mapping (`{`) unless the key holds text (`text_key`): a prompt template `{question}?`
    is text. A list is a list for every key, as it is in a recipe file, so a text key refuses
    `group=[a]` rather than storing the characters `[a]`. Anything else is plain text, exactly
    as typed: `#gpu` is not a comment, `*x` is not an alias. Either way the key's type decides
    what plain text means.
    """
    stripped = text.strip()
    yaml_starts = ("[", '"', "'") if text_key else ("[", "{", '"', "'")
    if not stripped.startswith(yaml_starts):
        _check_text(stripped, origin)
        return Scalar(stripped, plain=True, origin=origin)
    try:
        tree, _, end = _build(stripped, lambda mark: origin, origin)
    except RlflowError as err:
        if " #" not in stripped:
            raise
        raise RlflowError(
            [d.replace(help=_COMMENT_HELP) for d in err.diagnostics], err.exit_code
        ) from None
    rest = stripped[end:].strip()
    if rest:
        raise RlflowError(
            diagnostic(
                "recipe.override",
                f"`{rest}` after the value is not part of it",
                origin,
                _COMMENT_HELP,
            )
        )
    return tree


@dataclass
class _Frame:
    value: dict | list
    path: tuple
    key: str | None = None  # mappings: the key read, waiting for its value


def _build(text: str, at, whole: Origin) -> tuple[Any, dict[KeyPath, Origin], int]:
    """Events -> tree, iteratively (no recursion, whatever the depth); also where the last
    node ends. `at(mark)` turns a YAML position into an Origin; `whole` is the text's own."""
    origins: dict[KeyPath, Origin] = {}
    stack: list[_Frame] = []
    root: Any = None
    end = 0
    documents = 0
    try:
        for event in _events(text):
            if isinstance(event, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    raise _refuse(
                        "recipe.yaml",
                        "a recipe holds one YAML document; this is the start of a second",
                        at(event.start_mark),
                        "remove the `---` line, or split the file",
                    )
                continue
            if isinstance(event, yaml.AliasEvent):
                raise _refuse(
                    "recipe.yaml-alias",
                    f"YAML aliases (`*{event.anchor}`) are not allowed in recipes",
                    at(event.start_mark),
                    "write the value out; to share settings between recipes, use `defaults:`",
                )
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                frame = stack.pop()
                end = event.end_mark.index
                if not stack:
                    root = frame.value
                continue
            if not isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
                continue
            tag = event.tag
            if tag not in (None, "!") and not (
                isinstance(event, yaml.ScalarEvent) and tag == _STR_TAG
            ):
                raise _refuse(
                    "recipe.yaml-tag",
                    f"YAML tags (`{tag}`) are not allowed in recipes",
                    at(event.start_mark),
                    "remove the tag: each key's type is fixed by the schema; quote a value "
                    "to make it text",
                )
            parent = stack[-1] if stack else None
            if parent is not None and isinstance(parent.value, dict) and parent.key is None:
                _take_key(event, parent, origins, at)
                continue
            if isinstance(event, yaml.ScalarEvent):
                _check_text(event.value, at(event.start_mark))
                value: Any = Scalar(  # a plain scalar's style: None (PyYAML) or "" (libyaml)
                    event.value, not event.style and tag is None, at(event.start_mark)
                )
                end = event.end_mark.index
            else:
                if len(stack) >= MAX_DEPTH:
                    raise _refuse(
                        "recipe.yaml-depth",
                        f"the recipe nests deeper than {MAX_DEPTH} levels",
                        at(event.start_mark),
                        "recipes are a few sections deep; flatten this value",
                    )
                value = {} if isinstance(event, yaml.MappingStartEvent) else []
            if parent is None:
                root = value
                path: tuple = ()
            elif isinstance(parent.value, dict):
                path = parent.path + (parent.key,)
                parent.value[parent.key] = value
                parent.key = None
            else:
                path = parent.path + (len(parent.value),)
                parent.value.append(value)
            if isinstance(value, (dict, list)):
                stack.append(_Frame(value, path))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        raise RlflowError(
            diagnostic(
                "recipe.yaml",
                f"invalid YAML: {problem}",
                at(mark) if mark else whole,
                "fix the YAML syntax at this position",
            )
        ) from None
    return root, origins, end


def _events(text: str):
    """The text's YAML events: libyaml's (~25x faster than PyYAML's pure-Python parser, the
    same values and character positions) when it reads the text without complaint, else
    PyYAML's, whose errors and refusals the diagnostics word. The two differ on a few inputs,
    which go to PyYAML: tabs (libyaml accepts some PyYAML refuses), byte-order marks, and text
    without a final newline (libyaml places what ends at the end one line further)."""
    if _C_LOADER is not None and text.endswith("\n") and not _LIBYAML_DIFFERS.search(text):
        try:
            return list(yaml.parse(text, Loader=_C_LOADER))
        except (yaml.YAMLError, ValueError):  # ValueError: text UTF-8 cannot encode
            pass
    return yaml.parse(text, Loader=yaml.SafeLoader)


_C_LOADER = getattr(yaml, "CSafeLoader", None)  # None where PyYAML was built without libyaml
_LIBYAML_DIFFERS = re.compile("[\t\ufeff]")
_UNPASSABLE = re.compile("[\x00\ud800-\udfff]")


def _check_text(text: str, origin: Origin) -> None:
    """Text no program can receive: NUL ends a C string, and a lone surrogate (an escape like
    \\ud800, or undecodable bytes on the command line) is not Unicode at all."""
    bad = _UNPASSABLE.search(text)
    if bad:
        raise RlflowError(
            diagnostic(
                "recipe.bad-character",
                f"a value holds the character {bad[0]!r}, which no file, environment variable "
                f"or command line can carry",
                origin,
                "remove it (NUL, or half of a UTF-16 surrogate pair such as \\ud800)",
            )
        )


def _take_key(event, frame: _Frame, origins: dict, at) -> None:
    if not isinstance(event, yaml.ScalarEvent):
        raise _refuse(
            "recipe.yaml-key",
            "a key must be a name, not a list or a mapping",
            at(event.start_mark),
            "write `name: value`",
        )
    key = event.value
    _check_text(key, at(event.start_mark))
    path = frame.path + (key,)
    if key in frame.value:
        first = origins.get(path)
        raise _refuse(
            "recipe.duplicate-key",
            f"`{'.'.join(str(p) for p in path)}` is set twice",
            at(event.start_mark),
            "remove one of the two"
            + (f"; the first is at line {first.line}" if first and first.line else ""),
        )
    if all(isinstance(p, str) for p in path):
        origins[path] = at(event.start_mark)
    frame.key = key


def _refuse(code: str, message: str, origin: Origin, help: str) -> RlflowError:
    return RlflowError(diagnostic(code, message, origin, help))
