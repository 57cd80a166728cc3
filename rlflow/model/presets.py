"""Names of the built-in model presets (kept torch-free for the CLI's help text)."""

QWEN25VL_PRESET_NAMES = ("tiny", "qwen25vl-3b")  # rlflow/model/tiny.py PRESETS
QWEN3VL_PRESET_NAMES = ("qwen3vl-4b",)  # rlflow/model/families/qwen3vl/__init__.py QWEN3VL_PRESETS
PRESET_NAMES = QWEN25VL_PRESET_NAMES + QWEN3VL_PRESET_NAMES
