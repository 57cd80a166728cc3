"""Recipe loading: YAML files + `defaults:` chain + dotted overrides -> a validated `Recipe`.

Every value remembers where it was set (file:line:column, or the command line), so an error
names the exact place to fix. Loading collects all problems before raising, so one run shows
every bad key at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe.schema import Recipe

KeyPath = tuple[str, ...]
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


@dataclass(frozen=True)
class Origin:
    """Where a value was set: a file position or a command-line override."""

    file: str
    line: int | None = None
    column: int | None = None

    def describe(self) -> str:
        if self.line is None:
            return self.file
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True)
class LoadedRecipe:
    recipe: Recipe
    data: dict  # the merged, resolved plain dict (what gets written to the run directory)
    origins: dict[KeyPath, Origin]
    files: tuple[Path, ...]  # every recipe file read, defaults first

    def origin(self, *path: str) -> Origin | None:
        return self.origins.get(tuple(path))

    def diagnostic(
        self,
        path: KeyPath,
        code: str,
        message: str,
        help: str | None = None,
        severity: str = "error",
    ) -> Diagnostic:
        """A diagnostic pointing at the place that set `path` (or its nearest parent)."""
        origin = None
        for n in range(len(path), 0, -1):
            origin = self.origins.get(path[:n])
            if origin:
                break
        return _diag(code, message, origin, help, severity)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> LoadedRecipe:
    """Read `path` and its defaults, apply `key.path=value` overrides, validate, return."""
    data, origins, files = _load_with_defaults(Path(path), chain=())
    problems: list[Diagnostic] = []
    for text in overrides:
        _apply_override(text, data, origins, problems)
    if problems:
        raise RlflowError(problems)
    recipe = _build(Recipe, data, (), origins, problems)
    if problems:
        raise RlflowError(problems)
    return LoadedRecipe(recipe=recipe, data=data, origins=origins, files=tuple(files))


def dump_recipe(data: dict) -> str:
    """The resolved recipe as YAML, keys in schema order (what `--dry-run` prints and runs keep)."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)


def with_values(loaded: LoadedRecipe, values: dict[KeyPath, Any], origin: Origin) -> LoadedRecipe:
    """A copy of `loaded` with some keys set by rlflow itself (e.g. the cluster from --nodes)."""
    data = _deepcopy(loaded.data)
    origins = dict(loaded.origins)
    for path, value in values.items():
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        origins[path] = origin
    problems: list[Diagnostic] = []
    recipe = _build(Recipe, data, (), origins, problems)
    if problems:
        raise RlflowError(problems)
    return LoadedRecipe(recipe=recipe, data=data, origins=origins, files=loaded.files)


# --- reading YAML with positions ---------------------------------------------------------------


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _diag(
    code: str, message: str, origin: Origin | None, help: str | None = None, severity: str = "error"
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


def _read_yaml(path: Path) -> tuple[dict, dict[KeyPath, Origin]]:
    shown = _display(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RlflowError(
            _diag(
                "recipe.not-found",
                f"recipe file `{shown}` does not exist",
                None,
                "check the path; recipes live in recipes/*.yaml",
            )
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise RlflowError(
            _diag("recipe.unreadable", f"cannot read `{shown}`: {err}", None)
        ) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        origin = Origin(shown, mark.line + 1, mark.column + 1) if mark else Origin(shown)
        problem = getattr(err, "problem", None) or str(err)
        raise RlflowError(
            _diag(
                "recipe.yaml",
                f"invalid YAML: {problem}",
                origin,
                "fix the YAML syntax at this position",
            )
        ) from None
    if root is None:
        return {}, {}
    if not isinstance(root, yaml.MappingNode):
        raise RlflowError(
            _diag(
                "recipe.not-a-mapping",
                "a recipe must be a mapping of sections",
                Origin(shown, root.start_mark.line + 1, root.start_mark.column + 1),
            )
        )
    origins: dict[KeyPath, Origin] = {}
    constructor = yaml.SafeLoader("")
    return _node_to_python(root, (), shown, origins, constructor), origins


def _node_to_python(node, path: KeyPath, file: str, origins: dict, constructor) -> Any:
    if not isinstance(node, yaml.MappingNode):
        try:
            return constructor.construct_object(node, deep=True)
        except yaml.YAMLError as err:
            mark = node.start_mark
            raise RlflowError(
                _diag(
                    "recipe.yaml",
                    f"invalid value: {err}",
                    Origin(file, mark.line + 1, mark.column + 1),
                )
            ) from None
    result: dict = {}
    for key_node, value_node in node.value:
        key = str(key_node.value)
        mark = key_node.start_mark
        origin = Origin(file, mark.line + 1, mark.column + 1)
        if key in result:
            first = origins[path + (key,)]
            raise RlflowError(
                _diag(
                    "recipe.duplicate-key",
                    f"`{'.'.join(path + (key,))}` is set twice",
                    origin,
                    f"remove one of the two; the first is at line {first.line}",
                )
            )
        origins[path + (key,)] = origin
        result[key] = _node_to_python(value_node, path + (key,), file, origins, constructor)
    return result


def _load_with_defaults(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict, list[Path]]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(_display(p) for p in chain + (resolved,))
        raise RlflowError(
            _diag(
                "recipe.defaults-cycle",
                f"`defaults:` form a cycle: {cycle}",
                Origin(_display(path)),
                "remove one of the `defaults:` entries",
            )
        )
    own, own_origins = _read_yaml(path)
    parents = own.pop("defaults", [])
    defaults_origin = own_origins.pop(("defaults",), None)
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise RlflowError(
            _diag(
                "recipe.defaults",
                "`defaults:` must be a file name or a list of them",
                defaults_origin,
                "e.g. `defaults: base.yaml`",
            )
        )
    merged: dict = {}
    origins: dict[KeyPath, Origin] = {}
    files: list[Path] = []
    for parent in parents:
        parent_path = path.parent / parent
        if not parent_path.exists():
            raise RlflowError(
                _diag(
                    "recipe.defaults-missing",
                    f"`defaults:` names `{parent}`, which does not exist next to `{_display(path)}`",
                    defaults_origin,
                    "paths in `defaults:` are relative to the recipe file",
                )
            )
        data, data_origins, data_files = _load_with_defaults(parent_path, chain + (resolved,))
        _deep_merge(merged, origins, data, data_origins)
        files += [f for f in data_files if f not in files]
    _deep_merge(merged, origins, own, own_origins)
    files.append(resolved)
    return merged, origins, files


def _deep_merge(
    into: dict, into_origins: dict, new: dict, new_origins: dict, path: KeyPath = ()
) -> None:
    """Merge `new` over `into`: mappings merge key by key, everything else replaces."""
    for key, value in new.items():
        key_path = path + (key,)
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], into_origins, value, new_origins, key_path)
        else:
            into[key] = _deepcopy(value)
            for p in [p for p in into_origins if p[: len(key_path)] == key_path]:
                del into_origins[p]
            into_origins.update(
                {p: o for p, o in new_origins.items() if p[: len(key_path)] == key_path}
            )
        if key_path in new_origins:
            into_origins[key_path] = new_origins[key_path]


def _deepcopy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deepcopy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deepcopy(v) for v in value]
    return value


def _apply_override(text: str, data: dict, origins: dict, problems: list[Diagnostic]) -> None:
    origin = Origin(f"command line `{text}`")
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        problems.append(
            _diag(
                "recipe.override",
                f"cannot read override `{text}`",
                None,
                "write overrides as dotted.key=value, e.g. grpo.max_num_steps=20",
            )
        )
        return
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    path = tuple(key.split("."))
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if not isinstance(child, dict):
            if part not in node:
                problems.append(_unknown_key(path[: i + 1], list(node), origin))
            else:
                problems.append(
                    _diag(
                        "recipe.override",
                        f"`{'.'.join(path[: i + 1])}` is not a section",
                        origin,
                        f"`{'.'.join(path[: i + 1])}` holds a value; set it directly",
                    )
                )
            return
        node = child
    if path[-1] not in node and not _is_mapping_key(path):
        problems.append(_unknown_key(path, list(node), origin))
        return
    node[path[-1]] = value
    origins[path] = origin


def _is_mapping_key(path: KeyPath) -> bool:
    """True when `path`'s parent is a free-form mapping in the schema (rewards, env, mix)."""
    tp = Recipe
    for key in path[:-1]:
        if not dataclasses.is_dataclass(tp):
            return False
        hints = typing.get_type_hints(tp)
        if key not in hints:
            return False
        tp = hints[key]
    return get_origin(tp) is dict


# --- validation against the schema -------------------------------------------------------------


def _unknown_key(path: KeyPath, known: list[str], origin: Origin | None) -> Diagnostic:
    name = ".".join(path)
    close = difflib.get_close_matches(path[-1], known, n=1, cutoff=0.6)
    if close:
        help = f"did you mean `{'.'.join(path[:-1] + (close[0],))}`?"
    else:
        help = "known keys here: " + ", ".join(f"`{k}`" for k in sorted(known))
    return _diag("recipe.unknown-key", f"`{name}` is not a recipe key", origin, help)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(get_args(tp)[0])} to {_type_name(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a section (mapping)"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp)
    )


def _build(tp: Any, value: Any, path: KeyPath, origins: dict, problems: list[Diagnostic]) -> Any:
    """Convert `value` to type `tp`; append a diagnostic and return None on a mismatch."""
    name = ".".join(path) or "recipe"
    origin = origins.get(path)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(
                _diag(
                    "recipe.type",
                    f"`{name}` must be a section (a mapping of keys)",
                    origin,
                    f"got {value!r}",
                )
            )
            return None
        hints = typing.get_type_hints(tp)
        fields = [f.name for f in dataclasses.fields(tp)]
        for key in value:
            if key not in hints:
                problems.append(_unknown_key(path + (key,), fields, origins.get(path + (key,))))
        kwargs = {}
        for field_name in fields:
            if field_name not in value:
                problems.append(
                    _diag(
                        "recipe.missing-key",
                        f"`{'.'.join(path + (field_name,))}` is not set",
                        origin,
                        "every key needs a value: start the recipe with `defaults: base.yaml`, "
                        "which sets them all, or set this one",
                    )
                )
                continue
            kwargs[field_name] = _build(
                hints[field_name], value[field_name], path + (field_name,), origins, problems
            )
        return tp(**kwargs)
    return _check_value(tp, value, path, origins, problems)


def _check_value(
    tp: Any, value: Any, path: KeyPath, origins: dict, problems: list[Diagnostic]
) -> Any:
    name = ".".join(path)
    origin = origins.get(path)
    kind = get_origin(tp)

    def bad(extra: str = "") -> None:
        problems.append(
            _diag(
                "recipe.type",
                f"`{name}` is {value!r}, but must be {_type_name(tp)}",
                origin,
                extra or None,
            )
        )

    if kind in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            trial: list[Diagnostic] = []
            result = _check_value(option, value, path, origins, trial)
            if not trial:
                return result
        bad()
        return None
    if kind is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            bad(f"did you mean {close[0]!r}?" if close else "")
        return value
    if kind is list:
        if not isinstance(value, list):
            bad()
            return None
        return [_check_value(get_args(tp)[0], v, path, origins, problems) for v in value]
    if kind is dict:
        key_type, value_type = get_args(tp)
        if not isinstance(value, dict):
            bad()
            return None
        return {
            str(k): _check_value(value_type, v, path + (str(k),), origins, problems)
            for k, v in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            bad("write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            bad()
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)  # YAML 1.1 reads `1e-6` (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad()
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            bad()
        return value
    raise AssertionError(f"schema type {tp!r} is not handled by the recipe loader")
