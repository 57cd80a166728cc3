"""Per-node runtime environments (vLLM's own Python venv), built once per pin set and reused."""
