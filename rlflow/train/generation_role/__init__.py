"""The generation ranks' program under `placement: separate`, and the link to them.

generator.py    a generation rank: the rollout loop it runs
remote.py       the trainer's side: rollouts from the generation ranks
weight_sync.py  the new weights, trainer -> generation ranks
reshard.py      the weights re-laid from the trainer's parallel layout to the generators'
"""
