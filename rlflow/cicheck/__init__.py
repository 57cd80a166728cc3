"""`rlflow check-tests`: list every test that no CI shard collects.

    shards.py     CI files -> shards (pytest argument lists, each with the file:line it came
                  from), following the calls between them; read by
    workflows.py  GitHub Actions workflows (matrix expanded)
    scripts.py    shell scripts and Makefiles
    shard.py      the Shard model, ci-shards.yaml, the shared RF200/RF201 helpers
    collect.py    shard -> the test ids the real `pytest --collect-only` selects
    command.py    the Click command: shards, collection, report, exit codes

Light on purpose (pre-commit, login nodes): pyyaml and the standard library; pytest runs in a
subprocess, so nothing the tests import is loaded here.
"""
