"""`@record`: the data classes of check-pins, made for a fraction of `@dataclass`'s cost.

check-pins runs on every commit, so its start-up counts: `@dataclass` compiles six methods per
class (about a millisecond each class here, some twenty classes), which was a tenth of a check
of the real NeMo-RL tree. `record` makes the same classes, the subset of dataclasses they use:
fields from the annotations in order, defaults, `factory(list)` for a fresh mutable default,
construction by position or keyword, `__post_init__`, repr, equality and (frozen) hash by
value, frozen instances refuse assignment. Only `__init__` is compiled (construction is the
hot path: 20,000 requirements make 20,000 pins), and only when the class is first constructed;
the other methods are shared. `replace` is `dataclasses.replace`.
"""

from __future__ import annotations

from rlflow.record_methods import record_eq, record_hash, record_repr

_MISSING = object()


class FrozenInstanceError(AttributeError):
    """Assignment to a field of a frozen record (dataclasses raises its own of the same name)."""


class factory:  # noqa: N801 (reads like dataclasses' `field(default_factory=...)`)
    """A default made fresh for each instance: `packages: list = factory(list)`."""

    def __init__(self, make):
        self.make = make


def record(cls=None, /, *, frozen: bool = True):
    """Decorate a class like `@dataclass(frozen=frozen)`; see the module docstring."""

    def wrap(cls):
        names = tuple(cls.__dict__.get("__annotations__", {}))
        defaults = {n: cls.__dict__[n] for n in names if n in cls.__dict__}
        cls.__init__ = _lazy_init(cls, names, defaults, frozen)
        for name, value in defaults.items():
            if isinstance(value, factory):
                delattr(cls, name)  # as dataclasses does: the class keeps no shared value
        cls.__record_fields__ = names
        cls.__match_args__ = names
        cls.__repr__ = record_repr
        cls.__eq__ = record_eq
        cls.__hash__ = record_hash if frozen else None
        if frozen:
            cls.__setattr__ = _frozen
            cls.__delattr__ = _frozen
        return cls

    return wrap if cls is None else wrap(cls)


def replace(obj, /, **changes):
    """A copy of the record `obj` with some fields changed (`dataclasses.replace`)."""
    values = {n: getattr(obj, n) for n in obj.__record_fields__}
    values.update(changes)
    return obj.__class__(**values)


def _lazy_init(cls, names: tuple, defaults: dict, frozen: bool):
    """An `__init__` that compiles the class's own on first use, installs it and runs it: a
    check uses few of its twenty record classes (a finding's, a fix's), and each compiled
    `__init__` costs about 0.2 ms of start-up."""

    def __init__(self, *args, **kwargs):
        if cls.__init__ is __init__:
            cls.__init__ = _init(cls, names, defaults, frozen)
        cls.__init__(self, *args, **kwargs)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


def _init(cls, names: tuple, defaults: dict, frozen: bool):
    params, body, scope = [], [], {"_set": object.__setattr__, "_MISSING": _MISSING}
    for name in names:
        default = defaults.get(name, _MISSING)
        if isinstance(default, factory):
            scope[f"_make_{name}"] = default.make
            params.append(f"{name}=_MISSING")
            body.append(f"if {name} is _MISSING: {name} = _make_{name}()")
        elif default is not _MISSING:
            scope[f"_default_{name}"] = default
            params.append(f"{name}=_default_{name}")
        else:
            params.append(name)
        body.append(f"_set(self, {name!r}, {name})" if frozen else f"self.{name} = {name}")
    if hasattr(cls, "__post_init__"):
        body.append("self.__post_init__()")
    source = f"def __init__(self, {', '.join(params)}):\n" + "".join(
        f"    {line}\n" for line in body or ["pass"]
    )
    exec(source, scope)  # noqa: S102 (our own field names, from the class's annotations)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init


def _frozen(self, name, *value):
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


# For classes written by hand that behave as records (model.Location): the same methods.
refuse_assignment = _frozen
