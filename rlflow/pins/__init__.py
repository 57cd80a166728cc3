"""`rlflow check-pins`: catch submodule/pyproject pin drift before uv (or a launch) does.

The flow is `walk -> parse -> compare -> report` (and `fix` for `--fix`):

    command.py  the Click command: flags -> the steps below; exit codes
    walk.py     nested git submodules -> pyproject.toml files + submodule state (gitpython)
    parse.py    one pyproject.toml -> requirements, sources, indexes, each with file:line
      lines.py    TOML key path -> line:column (tomllib has no positions)
      urls.py     git/URL normalization (git+https vs https, .git, trailing slash)
    reach.py    which of those pins uv installs together (extras asked for, groups); pure
    compare.py  pins + submodule state -> findings (RF001...); pure
      versions.py do two specifier sets share a version?; pure
    policy.py   [tool.rlflow.pins] in the root pyproject: lockstep list + allowlist
    report.py   findings -> compiler-style diagnostics (text) or JSON
    fix.py      `--fix`: move root pins to the submodules' values with tomlkit
    model.py    the dataclasses passed between the steps
    example.py  the bundled example repository (`--example`)

This package is imported on login nodes and in pre-commit: it must stay light (no torch,
megatron or transformers), and gitpython is imported only when a repository has submodules.
"""
