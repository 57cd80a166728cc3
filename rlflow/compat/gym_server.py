"""One NeMo Gym server process, as Gym's `ng_run` starts it, less Ray and the per-server venv.

`python -m rlflow.compat.gym_server app.py`, in the server's folder, with Gym's two
environment variables (the global config, the server's name) set by rlflow/train/gym/servers.py.
Gym's `run_webserver` starts (or joins) a Ray cluster in every server process and `ng_run`
builds a uv venv per server; the servers rlflow starts run in rlflow's own environment (the
`gym` extra) and their `initialize_ray` does nothing, so a server that submits Ray tasks
itself is not supported (docs/gym.md#limits).
"""

from __future__ import annotations

import runpy
import sys


def _die_with_parent() -> None:
    """SIGTERM when the trainer that started this server exits, however it exits (its rank
    leaves with os._exit on errors, past any cleanup): no Gym server outlives its run."""
    import ctypes
    import os
    import signal

    parent = int(os.environ.get("RLFLOW_GYM_PARENT", "0"))
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if parent and os.getppid() != parent:  # it exited before prctl took effect
        sys.exit(1)


def main() -> None:
    _die_with_parent()
    from nemo_gym import server_utils

    server_utils.initialize_ray = lambda: None  # the patch: no Ray cluster per server
    entrypoint = sys.argv[1]
    sys.argv = [entrypoint]
    runpy.run_path(entrypoint, run_name="__main__")


if __name__ == "__main__":
    main()
