"""`rlflow check-pins`: catch submodule/pyproject pin drift before uv (or a launch) does.

The flow is `walk -> parse -> compare -> report` (and `fix` for `--fix`):

    walk.py     nested git submodules -> pyproject.toml files + submodule state (gitpython)
    parse.py    one pyproject.toml -> the pins uv will act on, each with file:line
    policy.py   [tool.rlflow.pins] in the root pyproject: lockstep list + allowlist
    compare.py  pins + submodule state + policy -> findings (RF001...); pure
    report.py   findings -> compiler-style diagnostics (text) or JSON
    fix.py      `--fix`: move root pins to the submodules' values with tomlkit
    example.py  the bundled example repository (`--example`)

This package is imported on login nodes and in pre-commit: it must stay light (no torch,
megatron or transformers), and gitpython is imported only when a repository has submodules.
"""
