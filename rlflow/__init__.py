"""rlflow: Slurm-native GRPO post-training for vision-language models."""

__version__ = "0.1.0"
