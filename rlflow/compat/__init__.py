"""Every patch rlflow applies to third-party code, in one place.

- cpu_compat.py: megatron-core's CUDA-only spots, made to run on CPU (no-op on a GPU).
- te_guard.py: lets megatron-bridge import without Transformer Engine.
- library_logs.py: quiets the libraries' import-time logging.
- vision_attention.py: batches HF Qwen2.5-VL's windowed vision attention (per model instance).
"""
