"""The built-in model the run directory caches (run_dir/model): a damaged copy found on resume
is set aside and written again, like a damaged checkpoint is reported and skipped, never a
JSONDecodeError from deep inside the model load."""

from __future__ import annotations

import json
from pathlib import Path

from rlflow.model.build import resolve_checkpoint
from rlflow.rules import load_checked

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"


def test_a_damaged_builtin_model_cache_is_written_again(tmp_path, capfd):
    model = load_checked(TINY).recipe.model
    target = resolve_checkpoint(model, cache_dir=tmp_path)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text('{"model_type": "qwen2_5_vl", "vision_con')  # garbled
    assert resolve_checkpoint(model, cache_dir=tmp_path) == target
    assert json.loads((target / "config.json").read_text()) == config
    err = capfd.readouterr().err
    assert f"the built-in model {target} was damaged (config.json: " in err
    (aside,) = tmp_path.glob(f"{target.name}.damaged-*")
    assert "vision_con" in (aside / "config.json").read_text()  # kept, not deleted
