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
            extra: list = dataclasses.field(default_factory=list)

        return Section

    return frozen(body()), dataclasses.dataclass(frozen=True)(body())


def test_repr_equality_and_hash_are_dataclasses_own():
    ours, theirs = twins()
    for args in [("a", (1, 2)), ("b'\n", (), ours("x", (3,), extra=())), ("c", (1,), None, 2.0)]:
        args += (None,) * (4 - len(args)) + ((),)  # `extra` hashable
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
    assert [f.name for f in dataclasses.fields(section)] == [
        "name",
        "sizes",
        "nested",
        "ratio",
        "extra",
    ]
    assert dataclasses.fields(section)[3].metadata == {"bound": "ge=0"}
    assert dataclasses.replace(section, ratio=1.0) == ours("a", (1,), None, 1.0)
    assert dataclasses.asdict(section) == {
        "name": "a",
        "sizes": (1,),
        "nested": None,
        "ratio": 0.5,
        "extra": [],
    }
    assert ours.__match_args__ == ("name", "sizes", "nested", "ratio", "extra")
    assert section.extra is not ours("a", (1,)).extra  # a fresh default each time
    assert ours(sizes=(2,), name="k", extra=[1]) == ours("k", (2,), None, 0.5, [1])


def test_wrong_arguments_fail_as_dataclasses_do():
    ours, theirs = twins()
    for args, kwargs in [(("a",), {}), (("a", (), 1, 2, [], 9), {}), (("a", ()), {"bad": 1})]:
        with pytest.raises(TypeError) as mine:
            ours(*args, **kwargs)
        with pytest.raises(TypeError) as reference:
            theirs(*args, **kwargs)
        assert str(mine.value) == str(reference.value)


def test_post_init_runs_after_the_fields_are_set():
    @frozen
    class Checked:
        size: int

        def __post_init__(self):
            if self.size < 0:
                raise ValueError("negative")

    assert Checked(1).size == 1
    with pytest.raises(ValueError, match="negative"):
        Checked(-1)


def test_a_method_the_class_defines_is_kept():
    @frozen
    class Scalar:
        text: str

        def __repr__(self) -> str:
            return self.text

    assert repr(Scalar("x")) == "x"
    assert Scalar("x") == Scalar("x")


def test_a_frozen_dataclass_may_extend_it():
    ours, _ = twins()

    @dataclasses.dataclass(frozen=True)
    class Wider(ours):
        more: int = 0

    wider = Wider("a", (1,), more=2)
    assert (wider.name, wider.ratio, wider.more) == ("a", 0.5, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        wider.more = 3
