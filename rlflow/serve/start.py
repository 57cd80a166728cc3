"""`rlflow serve`'s body: the policy loaded frozen, the server until Ctrl-C.

One rank, or with `parallelism.tensor_parallel_size` N a tensor-parallel engine over N local
processes (one GPU each, or the CPU): rank 0 serves and sends the others its plans
(rlflow/serve/tensor_parallel.py). Ctrl-C (SIGINT to the terminal's process group) or SIGTERM
to `rlflow serve` stops rank 0's server, whose last plan sends the others home.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError

MODEL_CACHE = Path.home() / ".cache" / "rlflow" / "models"  # built-in checkpoints are written here


def serve_forever(recipe, checkpoint: str, *, host, port, model_name) -> None:
    par = recipe.parallelism
    if (par.expert_parallel_size, par.pipeline_parallel_size, par.context_parallel_size) != (
        1, 1, 1,
    ):  # fmt: skip
        raise RlflowError(
            Diagnostic(
                "serve.parallel",
                "`rlflow serve` splits the model by tensor parallelism only "
                f"(expert {par.expert_parallel_size}, pipeline {par.pipeline_parallel_size}, "
                f"context {par.context_parallel_size})",
                help="set parallelism.expert_parallel_size=1 (and pipeline/context 1); "
                "parallelism.tensor_parallel_size=N runs N local ranks",
            )
        )
    args = (recipe, checkpoint, host, port, model_name)
    if par.tensor_parallel_size == 1:
        _serve_rank(0, 1, None, *args)
        return
    import torch.multiprocessing as mp

    from rlflow.parallel import _free_port

    tp = par.tensor_parallel_size
    context = mp.start_processes(
        _serve_rank, args=(tp, _free_port(), *args), nprocs=tp, start_method="spawn", join=False
    )
    # Ctrl-C reaches every process of the terminal's group: rank 0 stops its server (the others
    # ignore it and leave on rank 0's last plan). SIGTERM here is passed on to rank 0 as one.
    leader = context.processes[0].pid
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(leader, signal.SIGINT))
    while not context.join():
        pass


def _serve_rank(rank, world, rendezvous, recipe, checkpoint, host, port, model_name) -> None:
    from rlflow import parallel
    from rlflow.compat import library_logs
    from rlflow.model.build import load_policy, resolve_checkpoint
    from rlflow.serve.runner import ServerThread, following_engine, served_engine
    from rlflow.serve.tensor_parallel import PlanSender

    if world > 1:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous),
        )  # fmt: skip
        if rank:  # a follower leaves on rank 0's last plan, not on Ctrl-C
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    library_logs.quiet()
    layout = dataclasses.replace(recipe.parallelism, sequence_parallel="off")
    parallel.init_parallel(
        layout, seed=recipe.run.seed, timeout_s=recipe.watchdog.collective_timeout_s,
        placement=None,
    )  # fmt: skip
    group = None
    if world > 1:
        import torch
        import torch.distributed as dist

        ranks = tuple(range(world))
        group = parallel.CrossGroup(
            dist.new_group(ranks, backend="gloo"), ranks, torch.device("cpu")
        )
    path = resolve_checkpoint(recipe.model, cache_dir=MODEL_CACHE)  # (rank 0 writes a built-in)
    policy = load_policy(path, recipe.model, layout, trainable=False)
    if rank:
        from rlflow.serve.prompts import ChatEncoder

        follower = following_engine(policy, ChatEncoder(path).pad_token_id, recipe, group)
        while not follower.follow():
            pass
        parallel.shutdown()
        return
    server_cfg = recipe.generation.server
    plans = PlanSender(group) if group is not None else None
    served = served_engine(policy, path, recipe, model_name or checkpoint, plans=plans)
    served.engine.resume_followers()  # the others follow from now on
    thread = ServerThread(
        served, host or server_cfg.host, server_cfg.port if port is None else port,
        server_cfg.max_connections, server_cfg.idle_timeout_s,
    ).start()  # fmt: skip
    split = f", tensor parallel over {world} ranks" if world > 1 else ""
    print(
        f"rlflow serve: ready at {thread.url}/v1 (model `{served.model_name}`, "
        f"{policy.device.type}{split}, weight version {served.engine.weight_version})",
        flush=True,
    )
    try:
        thread.wait()
    except KeyboardInterrupt:
        print("rlflow serve: stopping", file=sys.stderr, flush=True)
    finally:
        served.engine.release_followers(close=True)
        thread.stop()
