"""GRPO training on the allocation: setup, the step loop, the rollout sources, the loss math and
checkpoints; the generation ranks' own program (`generation.placement: separate`) is in
generation_role/."""
