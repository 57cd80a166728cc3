"""Rollout generation backends behind one small interface (base.py)."""
