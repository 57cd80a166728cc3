"""Rollout generation backends behind one small interface (base.py), every one built by
factory.py's make_backend: rlflow's Megatron engine (megatron/), HF's generate (hf.py) and vLLM in
its own environment (vllm/)."""
