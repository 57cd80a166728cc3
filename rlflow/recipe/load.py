"""Recipe loading: YAML files + `defaults:` chain + dotted overrides -> a validated `Recipe`.

Every value remembers where it was set (file:line:column, or the command line), so an error
names the exact place to fix. Loading collects all problems before raising, so one run shows
every bad key at once.

Values are typed by the schema, not guessed by YAML (`rlflow.recipe.reader` keeps each scalar's
text; `rlflow.recipe.values` reads it as its key's type, by `rlflow.recipe.scalars`' YAML 1.2
rules): a string key gets exactly the characters written, and an unquoted value that YAML tools
would read as a different number (`12:00:00`, `010`, `1.10`) is refused with both readings.
Numbers must be finite everywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

import yaml

from rlflow.errors import Diagnostic, RlflowError
from rlflow.frozen import frozen
from rlflow.recipe import scalars
from rlflow.recipe.reader import MAX_BYTES, KeyPath, Origin, Scalar, read_tree, read_value
from rlflow.recipe.reader import diagnostic as _diag
from rlflow.recipe.schema import Recipe
from rlflow.recipe.values import (
    check_value,
    hints,
    holds_text,
    is_mapping_key,
    origin_of,
    quote_help,
    shown,
)

__all__ = ["KeyPath", "LoadedRecipe", "Origin", "dump_recipe", "load_recipe", "with_values"]


@frozen
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
    Strings that would read back as something else unquoted are quoted.

    libyaml's emitter writes it (~3x faster than PyYAML's pure-Python one) where the two write
    the same text: every string printable ASCII, every key 1 to 99 characters (a differential
    test holds this: tests/recipe/test_recipe_typed_yaml.py). Elsewhere PyYAML's writes it: the
    two fold long double-quoted strings (non-ASCII, control characters) apart, and write empty
    or long keys differently."""
    return _dump(data, _CDumper if _CDumper is not None and _emits_alike(data) else _Dumper)


def _dump(data: dict, dumper: type) -> str:
    return yaml.dump(data, Dumper=dumper, sort_keys=False, default_flow_style=False, width=100)


class _Dumper(yaml.SafeDumper):
    pass


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = None if scalars.reads_back_as_text(text) else "'"
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_str)
_CDumper = None
if hasattr(yaml, "CSafeDumper"):  # PyYAML built with libyaml

    class _CDumper(yaml.CSafeDumper):
        pass

    _CDumper.add_representer(str, _represent_str)


def _emits_alike(value) -> bool:
    """Whether libyaml's and PyYAML's emitters write `value` the same (see dump_recipe)."""
    if isinstance(value, str):
        return value.isascii() and value.isprintable()
    if isinstance(value, dict):
        return all(
            isinstance(key, str) and 0 < len(key) < 100 and _emits_alike(key) and _emits_alike(item)
            for key, item in value.items()
        )
    if isinstance(value, list):
        return all(_emits_alike(item) for item in value)
    return value is None or isinstance(value, (bool, int, float))  # the representer's words


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
            # The origins under `key_path` go with the value they describe. (Only a key `into`
            # holds has old ones, only a mapping or list new ones below it: scanning every origin
            # for each of base.yaml's ~400 keys was most of a recipe's load.)
            if key in into:
                for p in [p for p in into_origins if p[: len(key_path)] == key_path]:
                    del into_origins[p]
            if isinstance(value, (dict, list)):
                into_origins.update(
                    {p: o for p, o in new_origins.items() if p[: len(key_path)] == key_path}
                )
            into[key] = _deepcopy(value)
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
        value = read_value(raw, origin, text_key=holds_text(tuple(key.split("."))))
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
    if path[-1] not in node and not is_mapping_key(path):
        problems.append(_unknown_key(path, list(node), origin))
        return
    node[path[-1]] = value
    for stale in [p for p in origins if p[: len(path)] == path]:
        del origins[stale]  # positions of what the override replaced
    origins[path] = origin


# --- validation against the schema -------------------------------------------------------------


def _unknown_key(path: KeyPath, known: list[str], origin: Origin | None) -> Diagnostic:
    name = ".".join(path)
    close = difflib.get_close_matches(path[-1], known, n=1, cutoff=0.6)
    if close:
        help = f"did you mean `{'.'.join(path[:-1] + (close[0],))}`?"
    else:
        help = "known keys here: " + ", ".join(f"`{k}`" for k in sorted(known))
    return _diag("recipe.unknown-key", f"`{name}` is not a recipe key", origin, help)


def _build(tp: Any, value: Any, path: KeyPath, origins: dict, problems: list[Diagnostic]) -> Any:
    """Convert `value` to type `tp`; append a diagnostic and return None on a mismatch."""
    name = ".".join(path) or "recipe"
    origin = origins.get(path) or origin_of(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(
                _diag(
                    "recipe.type",
                    f"`{name}` must be a section (a mapping of keys)",
                    origin_of(value) or origin,
                    f"got {shown(value)}",
                )
            )
            return None
        types_of = hints(tp)
        fields = [f.name for f in dataclasses.fields(tp)]
        for key in value:
            if key not in types_of:
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
            f: _build(types_of[f], value[f], path + (f,), origins, problems)
            for f in fields
            if f in value
        }
        return None if missing else tp(**kwargs)
    return check_value(tp, value, path, origins, problems)


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
                + quote_help(name, scalar.text, origin),
            )
        )
    return problems
