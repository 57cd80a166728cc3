"""Policy models: the family interface and registry (family.py), one module or folder per family
(families/), mixture-of-experts (moe/), HF checkpoint <-> Megatron through megatron-bridge
(build.py), the forwards, and the tiny checkpoints (tiny.py). Third-party patches: rlflow/compat/."""
