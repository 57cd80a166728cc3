"""NeMo Gym environments as a rollout source (`environment.kind: gym`, docs/gym.md): Gym's
servers as child processes (servers.py), its trajectories as Completions (trajectory.py), the
trainer's RolloutSource over both (source.py)."""
