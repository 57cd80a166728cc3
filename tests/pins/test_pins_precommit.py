"""The shipped pre-commit hook, run by the real `pre-commit try-repo` in a throwaway repository.

pre-commit builds the hook's own virtualenv and pip-installs rlflow's light core into it
(click, pyyaml, jinja2, gitpython, tomlkit, packaging: no torch), so this test needs PyPI, like
any first use of a pre-commit hook. It runs pre-commit on this interpreter (Python 3.12), which
is how the hook's `language_version: python3.12` resolves without a pyenv shim.
"""

from __future__ import annotations

import os
import subprocess
import sys

from pins_helpers import REPO_ROOT, root_toml


def test_try_repo_blocks_a_commit_with_pin_drift(nested, tmp_path):
    layout = nested(root=root_toml(emo="v0.2.0"))
    env = {
        **os.environ,
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pre_commit",
            "try-repo",
            str(REPO_ROOT),
            "rlflow-check-pins",
            "--all-files",
            "--color",
            "never",
        ],
        cwd=layout.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "rlflow check-pins" in output and "Failed" in output
    assert "error[RF001]: conflicting git revs for `emerging-optimizers`" in output
    assert "Traceback" not in output
