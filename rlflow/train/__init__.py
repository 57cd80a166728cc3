"""GRPO training on the allocation: setup, the step loop, the loss math and checkpoints."""
