"""Recipe loading: YAML files + `defaults:` chain + dotted overrides -> a validated `Recipe`.

Every value remembers where it was set (file:line:column, or the command line), so an error
names the exact place to fix. Loading collects all problems before raising, so one run shows
every bad key at once.

Values are typed by the schema, not guessed by YAML (`rlflow.recipe.reader` keeps each scalar's
text; `rlflow.recipe.scalars` has the YAML 1.2 rules): a string key gets exactly the characters
written, and an unquoted value that YAML tools would read as a different number (`12:00:00`,
`010`, `1.10`) is refused with both readings. Numbers must be finite everywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe import scalars
from rlflow.recipe.reader import MAX_BYTES, KeyPath, Origin, Scalar, read_tree, read_value
from rlflow.recipe.reader import diagnostic as _diag
from rlflow.recipe.schema import Recipe

__all__ = ["KeyPath", "LoadedRecipe", "Origin", "dump_recipe", "load_recipe", "with_values"]


@dataclass(frozen=True)
class LoadedRecipe:
    recipe: Recipe
    data: dict  # the typed values as plain dicts (what gets written to the run directory)
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
        for n in range(len(path), -1, -1):
            origin = self.origins.get(path[:n])
            if origin:
                break
        return _diag(code, message, origin, help, severity)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> LoadedRecipe:
    """Read `path` and its defaults, apply `key.path=value` overrides, validate, return."""
    data, origins, files = _load_with_defaults(Path(path), chain=())
    top = Origin(_display(Path(path)))
    if not data:
        raise RlflowError(
            _diag(
                "recipe.empty",
                f"`{top.file}` sets nothing",
                top,
                "start the recipe with `defaults: base.yaml` (every key with its default) and "
                "list only the keys you change",
            )
        )
    origins[()] = top
    problems: list[Diagnostic] = []
    for text in overrides:
        _apply_override(text, data, origins, problems)
    if problems:
        raise RlflowError(problems)
    recipe = _build(Recipe, data, (), origins, problems)
    if problems:
        raise RlflowError(problems)
    return LoadedRecipe(recipe=recipe, data=_plain(recipe), origins=origins, files=tuple(files))


def dump_recipe(data: dict) -> str:
    """The resolved recipe as YAML, keys in schema order (what `--dry-run` prints and runs keep).
    Strings that would read back as something else unquoted are quoted."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


class _Dumper(yaml.SafeDumper):
    pass


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = None if scalars.reads_back_as_text(text) else "'"
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_str)


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
    return LoadedRecipe(recipe=recipe, data=_plain(recipe), origins=origins, files=loaded.files)


def _plain(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


# --- reading YAML with positions ---------------------------------------------------------------


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def _read_yaml(path: Path) -> tuple[dict, dict[KeyPath, Origin]]:
    shown = _display(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # bounded: a recipe may be /dev/zero
        text = raw.decode("utf-8")
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
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise RlflowError(
            _diag("recipe.unreadable", f"cannot read `{shown}`: {reason}", Origin(shown))
        ) from None
    root, origins = read_tree(text, shown)
    if root is None or (isinstance(root, Scalar) and root.plain and root.text == ""):
        return {}, {}
    if not isinstance(root, dict):
        where = root.origin if isinstance(root, Scalar) else Origin(shown)
        raise RlflowError(
            _diag(
                "recipe.not-a-mapping",
                "a recipe must be a mapping of sections (`section:` lines with keys under them)",
                where,
                "start with `defaults: base.yaml`, then e.g. `grpo:` and `  max_num_steps: 20`",
            )
        )
    return root, origins


def _defaults_list(value: Any, origin: Origin | None) -> list[str]:
    """`defaults:` as file names: one name, a list of them, or nothing."""
    if isinstance(value, Scalar):
        if value.plain and value.text in scalars.NULL_WORDS:
            return []
        return [value.text]
    if isinstance(value, list) and all(isinstance(v, Scalar) for v in value):
        return [v.text for v in value]
    raise RlflowError(
        _diag(
            "recipe.defaults",
            "`defaults:` must be a file name or a list of them",
            origin,
            "e.g. `defaults: base.yaml`",
        )
    )


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
    defaults_origin = own_origins.pop(("defaults",), None)
    parents = _defaults_list(own.pop("defaults", []), defaults_origin)
    merged: dict = {}
    origins: dict[KeyPath, Origin] = {}
    files: list[Path] = []
    for parent in parents:
        parent_path = path.parent / parent
        if not parent or "\0" in parent or not parent_path.is_file():
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
        value = read_value(raw, origin, text_key=_holds_text(tuple(key.split("."))))
    except RlflowError as err:
        problems += err.diagnostics
        return
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
    for stale in [p for p in origins if p[: len(path)] == path]:
        del origins[stale]  # positions of what the override replaced
    origins[path] = origin


def override_value(key: str, text: str) -> Any:
    """The value `key=text` gives its key, typed by the schema as `load_recipe` types it; None
    when it does not type (the full load reports why). Sweeps compare values with it."""
    path = tuple(key.split("."))
    tp = _type_at(path)
    if tp is None:
        return None
    problems: list[Diagnostic] = []
    try:
        value = read_value(text, Origin("command line"), text_key=_holds_text(path))
    except RlflowError:
        return None
    typed = _check_value(tp, value, path, {}, problems)
    return None if problems else typed


def _type_at(path: KeyPath) -> Any:
    """The schema type of `path` (a mapping's value type under rewards, env, mix), or None."""
    tp: Any = Recipe
    for key in path:
        if dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(key)
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            return None
        if tp is None:
            return None
    return None if dataclasses.is_dataclass(tp) else tp


def _holds_text(path: KeyPath) -> bool:
    """True when the schema types `path` as a string (or a string or null)."""
    tp: Any = Recipe
    for key in path:
        if dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(key)
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            return False
    options = get_args(tp) if get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(o is str or get_origin(o) is Literal for o in options)


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
    origin = origins.get(path) or _origin_of(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(
                _diag(
                    "recipe.type",
                    f"`{name}` must be a section (a mapping of keys)",
                    _origin_of(value) or origin,
                    f"got {_shown(value)}",
                )
            )
            return None
        hints = typing.get_type_hints(tp)
        fields = [f.name for f in dataclasses.fields(tp)]
        for key in value:
            if key not in hints:
                problems.append(_unknown_key(path + (key,), fields, origins.get(path + (key,))))
        missing = [f for f in fields if f not in value]
        if missing:
            names = ", ".join(f"`{'.'.join(path + (f,))}`" for f in missing)
            problems.append(
                _diag(
                    "recipe.missing-key",
                    f"{names} {'is' if len(missing) == 1 else 'are'} not set",
                    origin,
                    "every key needs a value: start the recipe with `defaults: base.yaml`, "
                    "which sets them all, or set " + ("this one" if len(missing) == 1 else "these"),
                )
            )
        problems += _unquoted_names(tp, value, path, origins)
        kwargs = {
            f: _build(hints[f], value[f], path + (f,), origins, problems)
            for f in fields
            if f in value
        }
        return None if missing else tp(**kwargs)
    return _check_value(tp, value, path, origins, problems)


def _unquoted_names(tp: Any, value: dict, path: KeyPath, origins: dict) -> list[Diagnostic]:
    """Keys whose bound says `quote_numbers` (names: `logging.wandb.entity`) refuse an unquoted
    number: `entity: 123` is the number 123 to YAML tools, so rlflow will not guess the name."""
    problems = []
    for field in dataclasses.fields(tp):
        rule = field.metadata.get("bound")
        scalar = value.get(field.name)
        if not getattr(rule, "quote_numbers", False) or not isinstance(scalar, Scalar):
            continue
        number = scalars.core_number(scalar.text) if scalar.plain else None
        if number is None:
            continue
        name = ".".join((*path, field.name))
        origin = scalar.origin or origins.get((*path, field.name))
        problems.append(
            _diag(
                "recipe.ambiguous",
                f"`{name}` is {scalar.text} without quotes, which YAML reads as the number "
                f"{scalars.shown(number)}",
                origin,
                f"this key holds a name: did you mean '{scalar.text}'? "
                + _quote_help(name, scalar.text, origin),
            )
        )
    return problems


def _origin_of(value: Any) -> Origin | None:
    return value.origin if isinstance(value, Scalar) else None


def _shown(value: Any) -> str:
    """A value as a diagnostic shows it: text quoted, numbers and words YAML reads bare."""
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    if isinstance(value, Scalar):
        return (
            value.text
            if value.plain and not scalars.reads_back_as_text(value.text)
            else repr(value.text)
        )
    return repr(value)


def _check_value(
    tp: Any, value: Any, path: KeyPath, origins: dict, problems: list[Diagnostic]
) -> Any:
    name = ".".join(path)
    origin = _origin_of(value) or origins.get(path)
    kind = get_origin(tp)

    def bad(extra: str = "") -> None:
        if not extra and isinstance(value, list | dict) and _takes_text(tp):
            extra = "this key holds one text value: to set text that starts with [ or {, quote it"
        problems.append(
            _diag(
                "recipe.type",
                f"`{name}` is {_shown(value)}, but must be {_type_name(tp)}",
                origin,
                extra or None,
            )
        )

    if kind in (typing.Union, types.UnionType):
        options = get_args(tp)
        if type(None) in options and _is_null(value):
            return None
        for option in options:
            if option is type(None):
                continue
            trial: list[Diagnostic] = []
            result = _check_value(option, value, path, origins, trial)
            if not trial:
                return result
            if len(options) == 2 and any(d.code != "recipe.type" for d in trial):
                problems += trial  # e.g. non-finite or ambiguous: more useful than "must be"
                return None
        bad()
        return None
    if kind is Literal:
        allowed = get_args(tp)
        text = value.text if isinstance(value, Scalar) else value
        if text not in allowed or (isinstance(value, Scalar) and _is_null(value)):
            close = difflib.get_close_matches(str(text), [str(a) for a in allowed], n=1)
            bad(f"did you mean {close[0]!r}?" if close else "")
            return None
        return text
    if kind is list:
        if not isinstance(value, list):
            bad()
            return None
        return [_check_value(get_args(tp)[0], v, path, origins, problems) for v in value]
    if kind is dict:
        _, value_type = get_args(tp)
        if not isinstance(value, dict):
            bad()
            return None
        return {
            str(k): _check_value(value_type, v, path + (str(k),), origins, problems)
            for k, v in value.items()
        }
    if isinstance(value, Scalar):
        return _read_scalar(tp, value, name, origin, problems, bad)
    # Python values: set by rlflow itself (with_values) or re-checked from `data`.
    if tp is bool:
        if not isinstance(value, bool):
            bad("write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            bad()
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad()
            return None
        return _finite(float(value), name, repr(value), origin, problems)
    if tp is str:
        if not isinstance(value, str):
            bad()
        return value
    raise AssertionError(f"schema type {tp!r} is not handled by the recipe loader")


def _takes_text(tp: Any) -> bool:
    options = get_args(tp) if get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return str in options


def _is_null(value: Any) -> bool:
    if isinstance(value, Scalar):
        return value.plain and value.text in scalars.NULL_WORDS
    return value is None


def _read_scalar(tp, value: Scalar, name: str, origin, problems: list[Diagnostic], bad) -> Any:
    """A scalar as written -> the key's type, by YAML 1.2 core rules (rlflow.recipe.scalars)."""
    text, plain = value.text, value.plain
    if tp is str:
        if not plain:
            return text
        if text in scalars.NULL_WORDS or scalars.as_bool(text) is not None:
            bad(f"did you mean '{text}'? " + _quote_help(name, text, origin))
            return None
        readings = scalars.other_readings(text)
        if readings:
            problems.append(
                _diag(
                    "recipe.ambiguous",
                    f"`{name}` is {text} without quotes, which YAML reads as {readings}",
                    origin,
                    f"did you mean '{text}'? " + _quote_help(name, text, origin),
                )
            )
            return None
        return text
    if tp is bool:
        flag = scalars.as_bool(text) if plain else None
        if flag is None:
            hint = "write true or false"
            if plain and text in scalars.YAML11_BOOL_WORDS:
                hint += f" (YAML 1.2 reads {text} as text, YAML 1.1 as a boolean)"
            bad(hint)
        return flag
    if plain and scalars.is_leading_zero(text) and tp in (int, float):
        problems.append(
            _diag(
                "recipe.ambiguous",
                f"`{name}` is {text}, which YAML reads as {scalars.other_readings(text)}",
                origin,
                f"write the number without the leading zero, e.g. {text.lstrip('+-0') or '0'}",
            )
        )
        return None
    if tp is int:
        number = scalars.as_int(text) if plain else None
        if number is None:
            bad()
        return number
    if tp is float:
        # Quoted numbers are accepted for number keys: the text has only one reading here.
        number = scalars.as_float(text) if plain or scalars.as_float(text) is not None else None
        if number is None:
            bad()
            return None
        return _finite(number, name, text, origin, problems)
    raise AssertionError(f"schema type {tp!r} is not handled by the recipe loader")


def _finite(number: float, name: str, text: str, origin, problems: list[Diagnostic]):
    if math.isfinite(number):
        return number
    problems.append(
        _diag(
            "recipe.non-finite",
            f"`{name}` is {text}: numbers in a recipe must be finite (not NaN or infinity)",
            origin,
            "write a finite number; NaN or infinity here would silently disable or break what "
            "the key controls",
        )
    )
    return None


def _quote_help(name: str, text: str, origin: Origin | None) -> str:
    if origin is not None and origin.is_command_line:
        return f"quote it inside the shell's quotes: '{name}=\"{text}\"'"
    return f'write it in quotes: "{text}"'
