"""Single-key bounds: declared once beside each field of rlflow.recipe.schema, reported by one rule.

    top_p: float = field(metadata=bound(gt=0, le=1))
    cpus_per_task: int | None = field(metadata=bound(ge=1))  # null is always allowed
    required_env: list[str] = field(metadata=bound(**ENV_NAMES, ...))  # each item
    time_limit: str = field(metadata=bound(parse=scalars.slurm_seconds, ...))

A bound says what one value may be: a range for a number, `nonempty` for a string or list, a
`pattern` or a `parse` function (a text format, e.g. a Slurm time) for a string. On a list it
holds for every item and on a mapping for every value (`keys` bounds the mapping's keys).
`bounded_values` walks a recipe; one rule (`_bounds` in rlflow.rules.checks) reports every
value outside its bound, naming the key and the value. Every integer must also fit in 64 bits
(torch, Slurm and C code take them), bound or not. A rule that relates two keys is not a
bound: it is a rule of rlflow.rules.checks.

`quote_numbers` is the loader's part (rlflow.recipe.load): a key that holds a name refuses an
unquoted number (`entity: 123`), which YAML tools read as a number, not a name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

from rlflow.frozen import frozen
from rlflow.recipe import scalars

INT64_MAX = 2**63 - 1


@frozen
class Bound:
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    nonempty: bool = False  # a string with a non-blank character, a list with an item
    pattern: str | None = None  # strings must match it in full (`says` words the failure)
    parse: Callable[[str], Any] | None = None  # strings must parse: ValueError(reason) if not
    says: str | None = None  # "`key` " + this, with {value} and {reason}, for pattern/parse
    keys: Bound | None = None  # a mapping's keys (the value bound covers its values)
    quote_numbers: bool = False  # a name: an unquoted number is refused (read by the loader)
    code: str = "recipe.range"
    help: str | None = None

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` (a message after "`key` "), or None when it holds;
        `help_for` says how to fix it."""
        if isinstance(value, bool):
            return None
        if isinstance(value, int | float):
            return self._range_problem(value)
        if self.nonempty and not (value.strip() if isinstance(value, str) else value):
            return "is empty"
        if not isinstance(value, str):
            return None
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            return self._said(value, "")
        if self.parse is not None:
            try:
                self.parse(value)
            except ValueError as err:
                return self._said(value, str(err))
        return None

    def help_for(self, value: Any) -> str | None:
        if (
            self.help is None
            and isinstance(value, int)
            and not -INT64_MAX - 1 <= value <= INT64_MAX
        ):
            return "integers go to torch, Slurm and C code, which take 64 bits"
        return self.help

    def _range_problem(self, value: int | float) -> str | None:
        low_ok = (self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
        high_ok = (self.lt is None or value < self.lt) and (self.le is None or value <= self.le)
        if not (low_ok and high_ok):
            return f"must {self.range_words()} (it is {shown(value)})"
        if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            return f"must fit in 64 bits (at most {INT64_MAX}), not {shown(value)}"
        return None

    def range_words(self) -> str:
        """`be in (0, 1]`, `be positive`, `not be negative`, `be at least 1`, `be at most 5`."""
        low = self.gt if self.gt is not None else self.ge
        high = self.lt if self.lt is not None else self.le
        if low is not None and high is not None:
            left = "(" if self.gt is not None else "["
            right = ")" if self.lt is not None else "]"
            return f"be in {left}{shown(low)}, {shown(high)}{right}"
        if self.gt is not None:
            return "be positive" if self.gt == 0 else f"be above {shown(self.gt)}"
        if self.ge is not None:
            return "not be negative" if self.ge == 0 else f"be at least {shown(self.ge)}"
        if self.lt is not None:
            return f"be below {shown(self.lt)}"
        return f"be at most {shown(self.le)}"

    def _said(self, value: str, reason: str) -> str:
        says = self.says or "is {value}, which is not allowed here"
        return says.format(value=repr(value), reason=reason)


def bound(**kwargs: Any) -> dict[str, Bound]:
    """Field metadata: `field(metadata=bound(ge=1, help=...))`. No default is added: a field
    with a bound is still required (defaults live in recipes/base.yaml)."""
    return {"bound": Bound(**kwargs)}


# Bounds several keys share.
ENV_NAMES = {
    "pattern": r"[A-Za-z_][A-Za-z0-9_]*",
    "code": "recipe.env-name",
    "help": "use letters, digits and underscores, not starting with a digit",
}


def command_line(code: str, help: str, *, nonempty: bool = False) -> dict[str, Bound]:
    """Text the job splits into words as the shell would."""
    return bound(
        nonempty=nonempty,
        parse=scalars.shell_words,
        code=code,
        says="is {value}, which cannot be split into words: {reason}",
        help=help,
    )


def of(field: dataclasses.Field) -> Bound | None:
    return field.metadata.get("bound")


def shown(number: int | float) -> str:
    if isinstance(number, float):
        return f"{number:g}"
    text = str(number)
    return text if len(text) <= 24 else f"a {len(text)}-digit number"


_NO_BOUND = Bound()  # the 64-bit check only
Found = tuple[tuple[str, ...], str, Any, Bound]  # (key path, name as written, value, bound)


def bounded_values(section: Any, path: tuple[str, ...] = ()) -> Iterator[Found]:
    """Every value in a recipe (sub)section with its bound and its name as the user writes it
    (`slurm.env.HOME`, `preflight.required_env[1]`); keys without a bound get the 64-bit check."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        key = (*path, field.name)
        if dataclasses.is_dataclass(value):
            yield from bounded_values(value, key)
            continue
        rule = of(field) or _NO_BOUND
        name = ".".join(key)
        if isinstance(value, list):
            if rule.nonempty and not value:
                yield key, name, value, rule
            items = dataclasses.replace(rule, nonempty=False)
            yield from ((key, f"{name}[{i}]", v, items) for i, v in enumerate(value))
        elif isinstance(value, dict):
            for k, v in value.items():
                if rule.keys is not None:
                    yield (*key, k), f"{name}.{k}", k, rule.keys
                yield (*key, k), f"{name}.{k}", v, rule
        elif value is not None:
            yield key, name, value, rule
