"""Rollout generation backends behind one small interface (base.py), built by factory.py."""
