"""Names of the built-in model presets (kept torch-free for the CLI's help text)."""

PRESET_NAMES = ("tiny", "qwen25vl-3b")
