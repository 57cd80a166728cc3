"""Names of the built-in model presets (kept torch-free for the CLI's help text)."""

QWEN25VL_PRESET_NAMES = ("tiny", "qwen25vl-3b")  # rlflow/model/tiny.py PRESETS
QWEN3VL_PRESET_NAMES = ("qwen3vl-4b",)  # rlflow/model/families/qwen3vl/__init__.py QWEN3VL_PRESETS
# rlflow/model/families/nemotron_h/__init__.py PRESETS
NEMOTRON_H_PRESET_NAMES = (
    "tiny-nemotron-h",
    "tiny-nemotron-h-moe",
    "nemotron-h-30b-a3b",
    "nemotron-h-30b-a3b-8l",
    "nemotron-h-30b-a3b-dense",
)
PRESET_NAMES = QWEN25VL_PRESET_NAMES + QWEN3VL_PRESET_NAMES + NEMOTRON_H_PRESET_NAMES
# rlflow/model/families/nemotron_omni/__init__.py PRESETS
NEMOTRON_OMNI_PRESET_NAMES = ("tiny-nemotron-omni", "nemotron-omni-30b-a3b")
PRESET_NAMES += NEMOTRON_OMNI_PRESET_NAMES
