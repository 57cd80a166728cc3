"""Let megatron-bridge 0.6.2 import without Transformer Engine, without faking TE for anyone else.

`megatron/bridge/peft/lora_layers.py` does an unguarded `import transformer_engine.pytorch as te`
(reached from `import megatron.bridge`); the ~40 other TE imports in megatron-core and the bridge
are guarded by try/except. A blanket fake `transformer_engine` module would make megatron-core
believe TE exists and pick TE layers. So this finder serves an inert stub *only* when the
importing module is `megatron.bridge.peft.lora_layers`, and drops the stub from sys.modules as
soon as that module has bound it: every other `import transformer_engine` still fails.
If real Transformer Engine is installed, the finder is never consulted (it is appended last).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types

_IMPORTER = "megatron.bridge.peft.lora_layers"
_NAMES = ("transformer_engine", "transformer_engine.pytorch")


class _AnyAttr(type):
    """Class whose every attribute is another class: `te.pytorch.Linear` etc. resolve to inert types."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyAttr(name, (), {})


class _StubModule(types.ModuleType):
    def __setattr__(self, key, value):
        # Keep `pytorch` unset on the package so `import transformer_engine.pytorch as te` goes
        # through __getattr__ below, where the stub removes itself from sys.modules.
        if key != "pytorch":
            super().__setattr__(key, value)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if self.__name__ == _NAMES[0] and name == "pytorch":
            child = sys.modules.get(_NAMES[1])
            for module_name in _NAMES:
                sys.modules.pop(module_name, None)
            return child
        return _AnyAttr(name, (), {})


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


class _LoraLayersOnlyFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _NAMES or _importing_module() != _IMPORTER:
            return None
        return importlib.util.spec_from_loader(
            fullname, _StubLoader(), is_package=fullname == _NAMES[0]
        )


def _importing_module() -> str | None:
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
        ("importlib", "_frozen_importlib", __name__)
    ):
        frame = frame.f_back
    return frame.f_globals.get("__name__") if frame is not None else None


def install() -> None:
    """Idempotent; a no-op when real Transformer Engine is importable."""
    if any(isinstance(f, _LoraLayersOnlyFinder) for f in sys.meta_path):
        return
    if importlib.util.find_spec("transformer_engine") is None:
        sys.meta_path.append(_LoraLayersOnlyFinder())
