"""`@record` (rlflow/pins/records.py) against `@dataclass`: the same classes, field for field."""

from __future__ import annotations

import dataclasses

import pytest

from rlflow.pins.records import FrozenInstanceError, factory, record, replace


@record
class Point:
    x: int
    y: int = 0
    tags: tuple = ()


@dataclasses.dataclass(frozen=True)
class DataPoint:
    x: int
    y: int = 0
    tags: tuple = ()


@record(frozen=False)
class Bag:
    name: str
    items: list = factory(list)

    def __post_init__(self):
        self.name = self.name.strip()


def test_frozen_records_behave_like_frozen_dataclasses():
    a, b = Point(1, y=2), Point(x=1, y=2)
    assert a == b and hash(a) == hash(b) and a != Point(1)
    assert repr(a) == repr(DataPoint(1, y=2)).replace("DataPoint", "Point")
    assert hash(a) == hash(DataPoint(1, 2)) and a != DataPoint(1, 2)  # same hash, other class
    assert {a, b} == {a} and Point.__match_args__ == DataPoint.__match_args__
    with pytest.raises(FrozenInstanceError):
        a.x = 3
    with pytest.raises(AttributeError):
        del a.y
    with pytest.raises(TypeError):
        Point()  # x is required
    assert replace(a, y=5) == Point(1, 5) and a.y == 2


def test_mutable_records_get_a_fresh_default_and_run_post_init():
    first, second = Bag(" a "), Bag("b")
    first.items.append(1)
    assert second.items == [] and first.name == "a"
    first.name = "c"
    assert first == Bag("c", [1])
    with pytest.raises(TypeError):
        hash(first)  # eq without frozen: unhashable, as a dataclass
    assert not hasattr(Bag, "items")
