"""`@frozen` (rlflow/frozen.py) makes the classes `@dataclass(frozen=True)` makes: the same
repr, equality, hash, refusal to assign, and dataclasses' functions on them."""

from __future__ import annotations

import dataclasses

import pytest

from rlflow.frozen import frozen


def twins():
    """The same class body under `@frozen` and under `@dataclass(frozen=True)`."""

    def body():
        class Section:
            name: str
            sizes: tuple[int, ...]
            nested: object = None
            ratio: float = dataclasses.field(default=0.5, metadata={"bound": "ge=0"})

        return Section

    return frozen(body()), dataclasses.dataclass(frozen=True)(body())


def test_repr_equality_and_hash_are_dataclasses_own():
    ours, theirs = twins()
    for args in [("a", (1, 2)), ("b'\n", (), ours("x", (3,))), ("c", (1,), None, 2.0)]:
        mine, reference = ours(*args), theirs(*args)
        assert repr(mine) == repr(reference)
        assert mine == ours(*args) and hash(mine) == hash(reference)
        assert mine != ours("other", ())
    assert ours("a", ()).__eq__(theirs("a", ())) is NotImplemented  # another class: not equal
    assert ours("a", ()) != theirs("a", ())
    with pytest.raises(TypeError, match="unhashable"):
        hash(ours("a", [1]))  # a list field, as with dataclasses


def test_instances_are_frozen_dataclasses():
    ours, _ = twins()
    section = ours("a", (1,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        section.name = "b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        del section.name
    assert dataclasses.is_dataclass(section)
    assert [f.name for f in dataclasses.fields(section)] == ["name", "sizes", "nested", "ratio"]
    assert dataclasses.fields(section)[3].metadata == {"bound": "ge=0"}
    assert dataclasses.replace(section, ratio=1.0) == ours("a", (1,), None, 1.0)
    assert dataclasses.asdict(section) == {"name": "a", "sizes": (1,), "nested": None, "ratio": 0.5}
    assert ours.__match_args__ == ("name", "sizes", "nested", "ratio")
    with pytest.raises(TypeError):
        ours("a")  # a missing field


def test_a_method_the_class_defines_is_kept():
    @frozen
    class Scalar:
        text: str

        def __repr__(self) -> str:
            return self.text

    assert repr(Scalar("x")) == "x"
    assert Scalar("x") == Scalar("x")
