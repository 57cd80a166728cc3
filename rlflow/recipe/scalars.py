"""What an unquoted scalar means: YAML 1.2 core-schema rules, applied once the key's type is known.

    null   ~, null, Null, NULL, or nothing        true/false   true, True, TRUE, false, ...
    int    123, -4, 0x1f, 0o17                    float        1.5, 1e-6, .5 (.inf and .nan: refused)

Anything else is text. YAML 1.1 (PyYAML's default, and many other tools) also reads `12:00:00`
as 43200, `010` as 8 and `1_000` as 1000. A string key given such a value unquoted is refused
with both readings (`other_readings`), because either the user or another tool reading the same
file would get a different value than expected. Quoting makes it text, always.

Also here: the text formats some string keys must read as (`slurm_seconds`, a Slurm time limit;
`shell_words`, a command line), which the schema's bounds name (rlflow.recipe.bounds).
"""

from __future__ import annotations

import math
import re
import shlex

import yaml

NULL_WORDS = frozenset({"", "~", "null", "Null", "NULL"})
TRUE_WORDS = frozenset({"true", "True", "TRUE"})
FALSE_WORDS = frozenset({"false", "False", "FALSE"})
# YAML 1.1 booleans that YAML 1.2 reads as text: quoted when rlflow writes a recipe out.
YAML11_BOOL_WORDS = frozenset(
    w for b in ("y", "yes", "n", "no", "on", "off") for w in (b, b.capitalize(), b.upper())
)

_DECIMAL = re.compile(r"[-+]?[0-9]+")
_OCTAL = re.compile(r"0o[0-7]+")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_INF = re.compile(r"[-+]?\.(inf|Inf|INF)")
_NAN = re.compile(r"\.(nan|NaN|NAN)")
_LEADING_ZERO = re.compile(r"[-+]?0[0-9]+")

_YAML11 = yaml.resolver.Resolver()
_YAML11_CONSTRUCTOR = yaml.constructor.SafeConstructor()


def as_bool(text: str) -> bool | None:
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    return None


def as_int(text: str) -> int | None:
    """YAML 1.2 core integer, or None. `010` is None here: see `is_leading_zero`."""
    if _DECIMAL.fullmatch(text) and not _LEADING_ZERO.fullmatch(text):
        return int(text)
    if _OCTAL.fullmatch(text):
        return int(text[2:], 8)
    if _HEX.fullmatch(text):
        return int(text[2:], 16)
    return None


def as_float(text: str) -> float | None:
    """YAML 1.2 core float (or integer, as a float), or None. May return inf or nan."""
    if _LEADING_ZERO.fullmatch(text):
        return None
    number = as_int(text)
    if number is not None:
        try:
            return float(number)
        except OverflowError:
            return math.inf
    if _FLOAT.fullmatch(text):
        return float(text)
    if _INF.fullmatch(text):
        return -math.inf if text.startswith("-") else math.inf
    if _NAN.fullmatch(text):
        return math.nan
    return None


def is_leading_zero(text: str) -> bool:
    """`010`: 10 in YAML 1.2 but 8 (octal) in YAML 1.1; a number key refuses to guess."""
    return bool(_LEADING_ZERO.fullmatch(text))


def core_number(text: str) -> int | float | None:
    """The number YAML 1.2's core schema reads in `text`, or None."""
    if _DECIMAL.fullmatch(text):
        return int(text)
    number = as_int(text)
    if number is not None:
        return number
    return as_float(text)


def yaml11_number(text: str) -> int | float | None:
    """The number YAML 1.1 (PyYAML's resolver) reads in `text`, or None."""
    tag = _YAML11.resolve(yaml.ScalarNode, text, (True, False))
    node = yaml.ScalarNode(tag, text)
    try:
        if tag == "tag:yaml.org,2002:int":
            return _YAML11_CONSTRUCTOR.construct_yaml_int(node)
        if tag == "tag:yaml.org,2002:float":
            return _YAML11_CONSTRUCTOR.construct_yaml_float(node)
    except (ValueError, OverflowError):
        return None
    return None


def shown(number: int | float) -> str:
    return repr(number)


def other_readings(text: str) -> str | None:
    """How YAML reads plain `text` as a number, when that differs from the text itself, e.g.
    "the number 43200 (YAML 1.1, base 60)"; None when the text reads as itself."""
    readings: dict[str, list[str]] = {}
    for version, number in (("YAML 1.2", core_number(text)), ("YAML 1.1", yaml11_number(text))):
        if number is not None and shown(number) != text:
            readings.setdefault(shown(number), []).append(version)
    if not readings:
        return None
    if len(readings) == 1:
        ((value, versions),) = readings.items()
        which = "" if len(versions) == 2 else f" ({versions[0]}{_kind(text)})"
        return f"the number {value}{which}"
    parts = [
        f"{value} ({versions[0]}{_kind(text) if versions[0] == 'YAML 1.1' else ''})"
        for value, versions in readings.items()
    ]
    return "the number " + " or ".join(parts)


def _kind(text: str) -> str:
    if ":" in text:
        return ", base 60"
    if _LEADING_ZERO.fullmatch(text.replace("_", "")):
        return ", octal"
    return ""


def reads_back_as_text(text: str) -> bool:
    """True when `text`, written unquoted, reads back as exactly this text everywhere
    (rlflow's rules and YAML 1.1 tools alike); otherwise it must be written quoted."""
    if text in NULL_WORDS or text in TRUE_WORDS or text in FALSE_WORDS:
        return False
    if text in YAML11_BOOL_WORDS:
        return False
    return core_number(text) is None and yaml11_number(text) is None


# Slurm's --time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
TIME_FORMATS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"


def slurm_seconds(text: str) -> int:
    """A Slurm time limit (--time) -> seconds; ValueError saying why for anything else, for a
    field out of range (`1:99`: minutes and seconds go up to 59, hours after a day to 23), and
    for 0 (Slurm's "no limit": rlflow needs one to plan the time-limit save and GPU-hours)."""
    match = _TIME.fullmatch(text.strip())
    if not match:
        raise ValueError(f"use {TIME_FORMATS}")
    days, first, second, third = match.groups()
    if days is None and third is None:  # minutes, or MM:SS
        units = [(first, 60, "", None), (second, 1, "seconds", 59)]
    elif days is None:  # HH:MM:SS (hours may pass 23)
        units = [(first, 3600, "", None), (second, 60, "minutes", 59), (third, 1, "seconds", 59)]
    else:  # D-HH[:MM[:SS]]
        units = [
            (days, 86400, "", None),
            (first, 3600, "hours", 23),
            (second, 60, "minutes", 59),
            (third, 1, "seconds", 59),
        ]
    seconds = 0
    for digits, scale, unit, most in units:
        if digits is None:
            continue
        if most is not None and int(digits) > most:
            raise ValueError(f"{unit} go up to {most}, not {digits}")
        seconds += int(digits) * scale
    if seconds == 0:
        raise ValueError("0 means no limit to Slurm; rlflow needs one (the time-limit save)")
    return seconds


def parse_time_limit(text: str) -> int | None:
    """Slurm's --time formats -> seconds; None if the text is not one of them (or is 0)."""
    try:
        return slurm_seconds(text)
    except ValueError:
        return None


def shell_words(text: str) -> list[str]:
    """A command line split as the shell would; ValueError (e.g. "No closing quotation")."""
    return shlex.split(text)
