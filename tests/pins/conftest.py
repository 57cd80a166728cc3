"""Fixtures for the check-pins tests: real git repositories with real nested submodules,
built per test from local paths (see pins_helpers.py for the layout)."""

from __future__ import annotations

import pytest
from pins_helpers import (
    BRIDGE_PATH,
    Layout,
    add_submodule,
    bridge_toml,
    lm_toml,
    make_repo,
    root_toml,
)


@pytest.fixture
def nested(tmp_path):
    """Factory: nested(root=..., bridge=..., lm=...) -> Layout with everything committed."""

    def build(root: str | None = None, bridge: str | None = None, lm: str | None = None) -> Layout:
        up_lm = make_repo(
            tmp_path / "upstream" / "Megatron-LM", {"pyproject.toml": lm or lm_toml()}
        )
        up_bridge = make_repo(
            tmp_path / "upstream" / "Megatron-Bridge", {"pyproject.toml": bridge or bridge_toml()}
        )
        add_submodule(up_bridge, up_lm, "3rdparty/Megatron-LM")
        trainer = make_repo(tmp_path / "trainer", {"pyproject.toml": root or root_toml()})
        add_submodule(trainer, up_bridge, BRIDGE_PATH)
        return Layout(trainer, up_bridge, up_lm)

    return build
