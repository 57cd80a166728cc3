"""Policy models: HF checkpoint <-> Megatron through megatron-bridge, and the CPU compatibility layer."""
