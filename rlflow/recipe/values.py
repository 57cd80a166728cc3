"""One value against its schema type: YAML 1.2 scalars read as the key's type, and the
diagnostic for a value of the wrong type (rlflow.recipe.load builds whole sections with it).

A scalar keeps its text until here (rlflow.recipe.reader); `check_value` reads it as the schema
says (rlflow.recipe.scalars has the YAML 1.2 rules): a string key gets exactly the characters
written, numbers must be finite, and an unquoted value that other YAML tools read differently
is refused with both readings. `override_value` types one `key=value` the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe import scalars
from rlflow.recipe.reader import KeyPath, Origin, Scalar, read_value
from rlflow.recipe.reader import diagnostic as _diag
from rlflow.recipe.schema import Recipe


def override_value(key: str, text: str) -> Any:
    """The value `key=text` gives its key, typed by the schema as `load_recipe` types it; None
    when it does not type (the full load reports why). Sweeps compare values with it."""
    path = tuple(key.split("."))
    tp = type_at(path)
    if tp is None:
        return None
    problems: list[Diagnostic] = []
    try:
        value = read_value(text, Origin("command line"), text_key=holds_text(path))
    except RlflowError:
        return None
    typed = check_value(tp, value, path, {}, problems)
    return None if problems else typed


@functools.cache
def hints(tp: type) -> dict[str, Any]:
    """A schema class's field types, evaluated once per process (`typing.get_type_hints` reads
    the annotations' text each time it is called: ~0.5 ms a class, every load building each
    class twice). Shared: callers never change it."""
    return typing.get_type_hints(tp)


def _schema_type(path: KeyPath) -> Any:
    """The schema's type at `path`, a section's dataclass included (a mapping's value type under
    rewards, env, mix), or None where the schema has no such key."""
    tp: Any = Recipe
    for key in path:
        if dataclasses.is_dataclass(tp):
            tp = hints(tp).get(key)
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            return None
        if tp is None:
            return None
    return tp


def type_at(path: KeyPath) -> Any:
    """The schema type of `path` (a mapping's value type under rewards, env, mix), or None."""
    tp = _schema_type(path)
    return None if dataclasses.is_dataclass(tp) else tp


def holds_text(path: KeyPath) -> bool:
    """True when the schema types `path` as a string (or a string or null)."""
    tp = _schema_type(path)
    options = get_args(tp) if get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(o is str or get_origin(o) is Literal for o in options)


def is_mapping_key(path: KeyPath) -> bool:
    """True when `path`'s parent is a free-form mapping in the schema (rewards, env, mix)."""
    tp = Recipe
    for key in path[:-1]:
        if not dataclasses.is_dataclass(tp):
            return False
        types_of = hints(tp)
        if key not in types_of:
            return False
        tp = types_of[key]
    return get_origin(tp) is dict


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {type_name(get_args(tp)[0])} to {type_name(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a section (mapping)"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp)
    )


def origin_of(value: Any) -> Origin | None:
    return value.origin if isinstance(value, Scalar) else None


def shown(value: Any) -> str:
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


def check_value(
    tp: Any, value: Any, path: KeyPath, origins: dict, problems: list[Diagnostic]
) -> Any:
    name = ".".join(path)
    origin = origin_of(value) or origins.get(path)
    kind = get_origin(tp)

    def bad(extra: str = "") -> None:
        if not extra and isinstance(value, list | dict) and takes_text(tp):
            extra = "this key holds one text value: to set text that starts with [ or {, quote it"
        problems.append(
            _diag(
                "recipe.type",
                f"`{name}` is {shown(value)}, but must be {type_name(tp)}",
                origin,
                extra or None,
            )
        )

    if kind in (typing.Union, types.UnionType):
        options = get_args(tp)
        if type(None) in options and is_null(value):
            return None
        for option in options:
            if option is type(None):
                continue
            trial: list[Diagnostic] = []
            result = check_value(option, value, path, origins, trial)
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
        if text not in allowed or (isinstance(value, Scalar) and is_null(value)):
            close = difflib.get_close_matches(str(text), [str(a) for a in allowed], n=1)
            bad(f"did you mean {close[0]!r}?" if close else "")
            return None
        return text
    if kind is list:
        if not isinstance(value, list):
            bad()
            return None
        return [check_value(get_args(tp)[0], v, path, origins, problems) for v in value]
    if kind is dict:
        _, value_type = get_args(tp)
        if not isinstance(value, dict):
            bad()
            return None
        return {
            str(k): check_value(value_type, v, path + (str(k),), origins, problems)
            for k, v in value.items()
        }
    if isinstance(value, Scalar):
        return read_scalar(tp, value, name, origin, problems, bad)
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
        return finite(float(value), name, repr(value), origin, problems)
    if tp is str:
        if not isinstance(value, str):
            bad()
        return value
    raise AssertionError(f"schema type {tp!r} is not handled by the recipe loader")


def takes_text(tp: Any) -> bool:
    options = get_args(tp) if get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return str in options


def is_null(value: Any) -> bool:
    if isinstance(value, Scalar):
        return value.plain and value.text in scalars.NULL_WORDS
    return value is None


def read_scalar(tp, value: Scalar, name: str, origin, problems: list[Diagnostic], bad) -> Any:
    """A scalar as written -> the key's type, by YAML 1.2 core rules (rlflow.recipe.scalars)."""
    text, plain = value.text, value.plain
    if tp is str:
        if not plain:
            return text
        if text in scalars.NULL_WORDS or scalars.as_bool(text) is not None:
            bad(f"did you mean '{text}'? " + quote_help(name, text, origin))
            return None
        readings = scalars.other_readings(text)
        if readings:
            problems.append(
                _diag(
                    "recipe.ambiguous",
                    f"`{name}` is {text} without quotes, which YAML reads as {readings}",
                    origin,
                    f"did you mean '{text}'? " + quote_help(name, text, origin),
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
        return finite(number, name, text, origin, problems)
    raise AssertionError(f"schema type {tp!r} is not handled by the recipe loader")


def finite(number: float, name: str, text: str, origin, problems: list[Diagnostic]):
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


def quote_help(name: str, text: str, origin: Origin | None) -> str:
    if origin is not None and origin.is_command_line:
        return f"quote it inside the shell's quotes: '{name}=\"{text}\"'"
    return f'write it in quotes: "{text}"'
