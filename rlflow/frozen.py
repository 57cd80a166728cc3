"""`@frozen`: `@dataclass(frozen=True)` that compiles three methods per class instead of six.

The login-node commands build ~50 frozen dataclasses on every start (the recipe's sections,
the job plan, the reader's origins), and Python 3.12's `dataclass` compiles each generated
method from source: six a class, about a millisecond, a tenth of `submit --dry-run`. `@frozen`
lets `dataclass` make only `__init__` and the frozen `__setattr__`/`__delattr__`, and gives
every class the same `__repr__`, `__eq__` and `__hash__` functions, which return what
dataclasses' would (by value, over the fields in order). A method the class defines itself is
kept. The result is a dataclass like any other: `dataclasses.fields`, `replace`, `asdict` work.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


def frozen(cls):
    """Decorate like `@dataclass(frozen=True)`; see the module docstring."""
    own = {name for name in ("__repr__", "__eq__", "__hash__") if name in cls.__dict__}
    cls = dataclass(frozen=True, repr=False, eq=False)(cls)
    for name, method in (("__repr__", _repr), ("__eq__", _eq), ("__hash__", _hash)):
        if name not in own:
            setattr(cls, name, method)
    return cls


def _values(obj) -> tuple:
    return tuple(getattr(obj, f.name) for f in fields(obj))


def _repr(self) -> str:
    values = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
    return f"{self.__class__.__qualname__}({values})"


def _eq(self, other):
    if other.__class__ is self.__class__:
        return _values(self) == _values(other)
    return NotImplemented


def _hash(self) -> int:
    return hash(_values(self))
