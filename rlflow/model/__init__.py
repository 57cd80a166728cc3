"""Policy models: one module per model family behind family.py, HF checkpoint <-> Megatron
through megatron-bridge (build.py), the forwards, and third-party patches (compat/)."""
