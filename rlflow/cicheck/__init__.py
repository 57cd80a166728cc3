"""`rlflow check-tests`: list every test that no CI shard collects.

    shards.py   CI files -> shards (pytest argument lists, each with the file:line it came from):
                GitHub Actions workflows (matrix expanded), shell scripts, ci-shards.yaml
    collect.py  shard -> the test ids the real `pytest --collect-only` selects
    command.py  the Click command: shards, collection, report, exit codes

Light on purpose (pre-commit, login nodes): pyyaml and the standard library; pytest runs in a
subprocess, so nothing the tests import is loaded here.
"""
