"""The lock level of `check-pins`: is the root's uv.lock what `uv lock` would write now.

level.py     the checks, run in order (RF011 and friends)
settings.py  uv's staleness test, part one: the [tool.uv] settings the lock records
projects.py  part two: the record of each local project
lowering.py  a pyproject.toml -> the record uv writes of it
uvlock.py    read a uv.lock fast; tables.py its local packages' metadata tables
words.py     what a stale lock is, in words (`Stale`)
"""
