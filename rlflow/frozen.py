"""`@frozen`: a `@dataclass(frozen=True)` that compiles one method per class instead of six.

The login-node commands define ~50 frozen dataclasses on every start (the recipe's sections,
the job plan, the reader's origins), and Python 3.12's `dataclass` compiles each generated
method from source: six a class, about a millisecond, a tenth of `submit --dry-run`. `@frozen`
asks `dataclass` for the fields only and compiles just `__init__` (construction by position or
keyword, defaults, `field(default_factory=...)`, `__post_init__`). The other methods are shared
functions (rlflow/record_methods.py, shared with check-pins' records) that behave as
dataclasses' do: repr, equality and hash by value over the fields in
order, `FrozenInstanceError` on assignment or deletion. A method the class defines is kept.
The result is a dataclass like any other: `dataclasses.fields`, `replace`, `asdict` and field
metadata work. (rlflow/pins/records.py is check-pins' own, lighter variant, no dataclasses.)
"""

from __future__ import annotations

from dataclasses import MISSING, FrozenInstanceError, dataclass, fields

from rlflow.record_methods import record_eq, record_hash, record_repr

_SHARED = ("__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__")


def frozen(cls):
    """Decorate like `@dataclass(frozen=True)`; see the module docstring."""
    own = {name for name in _SHARED if name in cls.__dict__}
    if cls.__doc__ is None:  # dataclass would write one from inspect.signature: the name will do
        cls.__doc__ = cls.__name__
    cls = dataclass(init=False, repr=False, eq=False)(cls)
    # What it is (its instances refuse assignment), so `@dataclass(frozen=True)` may subclass it.
    cls.__dataclass_params__.frozen = True
    cls.__init__ = _init(cls)
    cls.__record_fields__ = tuple(f.name for f in fields(cls))
    shared = (record_repr, record_eq, record_hash, _refuse, _refuse)
    for name, method in zip(_SHARED, shared, strict=True):
        if name not in own:
            setattr(cls, name, method)
    return cls


def _init(cls):
    """`__init__(self, <the fields, in order, with their defaults>)`, setting each field the way
    a frozen dataclass does (object.__setattr__)."""
    params, body, scope = [], [], {"_set": object.__setattr__, "_MISSING": MISSING}
    for f in fields(cls):
        if f.default_factory is not MISSING:
            scope[f"_make_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            body.append(f"if {f.name} is _MISSING: {f.name} = _make_{f.name}()")
        elif f.default is not MISSING:
            scope[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        else:
            params.append(f.name)
        body.append(f"_set(self, {f.name!r}, {f.name})")
    if hasattr(cls, "__post_init__"):
        body.append("self.__post_init__()")
    source = f"def __init__(self, {', '.join(params)}):\n" + "".join(
        f"    {line}\n" for line in body or ["pass"]
    )
    exec(source, scope)  # noqa: S102 (the class's own field names)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init


def _refuse(self, name, *value):
    raise FrozenInstanceError(f"cannot assign to field {name!r}")
