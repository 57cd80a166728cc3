"""The rollout engine behind an OpenAI-compatible HTTP server: continuous batching (engine.py),
the Chat Completions API (app.py) and `rlflow serve` (command.py)."""
