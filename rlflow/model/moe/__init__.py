"""Mixture-of-experts: the grouped experts (experts.py) and router replay (routing.py)."""
