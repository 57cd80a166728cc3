"""`rlflow serve`'s body: one rank, the policy loaded frozen, the server until Ctrl-C."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError

MODEL_CACHE = Path.home() / ".cache" / "rlflow" / "models"  # built-in checkpoints are written here


def serve_forever(recipe, checkpoint: str, *, host, port, model_name) -> None:
    from rlflow import parallel
    from rlflow.compat import library_logs
    from rlflow.model.build import load_policy, resolve_checkpoint
    from rlflow.serve.runner import ServerThread, served_engine

    par = recipe.parallelism
    if (par.tensor_parallel_size, par.expert_parallel_size) != (1, 1):
        raise RlflowError(
            Diagnostic(
                "serve.one-rank",
                "`rlflow serve` runs the model on one rank (one GPU, or the CPU)",
                help="set parallelism.tensor_parallel_size=1 parallelism.expert_parallel_size=1",
            )
        )
    library_logs.quiet()
    single = dataclasses.replace(par, sequence_parallel="off")
    parallel.init_parallel(
        single, seed=recipe.run.seed, timeout_s=recipe.watchdog.collective_timeout_s,
        placement=None,
    )  # fmt: skip
    path = resolve_checkpoint(recipe.model, cache_dir=MODEL_CACHE)
    policy = load_policy(path, recipe.model, single, trainable=False)
    server_cfg = recipe.generation.server
    served = served_engine(policy, path, recipe, model_name or checkpoint)
    thread = ServerThread(
        served, host or server_cfg.host, server_cfg.port if port is None else port,
        server_cfg.max_connections, server_cfg.idle_timeout_s,
    ).start()  # fmt: skip
    print(
        f"rlflow serve: ready at {thread.url}/v1 (model `{served.model_name}`, "
        f"{policy.device.type}, weight version {served.engine.weight_version})",
        flush=True,
    )
    try:
        thread.wait()
    except KeyboardInterrupt:
        print("rlflow serve: stopping", file=sys.stderr, flush=True)
    finally:
        thread.stop()
