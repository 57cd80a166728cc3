"""Datasets, prompts and rewards shared by the trainer and the generation backends."""
