"""rlflow's own Megatron generation engine: the engine (engine.py), the decoder and prefill, the
paged KV cache and its schedule, flash decode (and its Triton kernels), FP8 rollouts, MoE decode,
expert-parallel lockstep and sampling. generation/factory.py builds it."""
