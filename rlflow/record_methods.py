"""The methods rlflow's two light data-class decorators share: repr, equality and hash by value
over the class's `__record_fields__` (its field names, in order).

`@frozen` (rlflow/frozen.py) makes real dataclasses for the login node's commands;
`@record` (rlflow/pins/records.py) makes check-pins' records without importing dataclasses.
Both compile only `__init__` per class and take these from here. No imports: check-pins runs
on every commit, and this module sits below everything.
"""

from __future__ import annotations


def values(obj) -> tuple:  # by getattr: a hand-written record may compute a field
    return tuple(getattr(obj, n) for n in obj.__record_fields__)


def record_repr(self) -> str:
    fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__record_fields__)
    return f"{self.__class__.__qualname__}({fields})"


def record_eq(self, other):
    if other.__class__ is self.__class__:
        return values(self) == values(other)
    return NotImplemented


def record_hash(self) -> int:
    return hash(values(self))
