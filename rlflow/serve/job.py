"""The server's life inside `rlflow train` (`generation.server.enabled`): each generation rank
(a colocated trainer, or a rank of `generation.placement: separate`) serves its own engine.

    announce()    at the rank's setup: RUN_DIR/servers/rank-R.json says waiting_for_weights
    start()       after the first weight load (colocated) or sync (separate): the server listens
                  on port + local rank, the record says ready, with its URL and weight version
    paused(v)     around the rank's own work on the model (rollouts, logprob passes, the update,
                  a weight sync): the server first answers the requests it holds, then waits;
                  afterwards it serves version v (the engine's update path, so a request that
                  spans it is finished and marked, or refused: generation.server.on_weight_update)
    stop()        at the end of the run: the record says stopped
    mark_failed() a rank that fails before or after: the record says failed, with the error, so
                  nothing waits for a server that will never answer

The server runs without CUDA graphs in a job (a capture in the server's thread would race the
trainer's own kernels); its KV cache is its own (generation.kv_cache_tokens sizes it).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from contextlib import contextmanager
from pathlib import Path

from rlflow.serve import registry

_current: JobServer | None = None  # this process's server, for mark_failed


class JobServer:
    """One generation rank's server and its record in the run directory."""

    def __init__(self, recipe, run_dir: Path, checkpoint: Path, rank: int, local_rank: int):
        global _current
        self.recipe, self.run_dir, self.rank = recipe, Path(run_dir), rank
        self.checkpoint = checkpoint
        self.cfg = recipe.generation.server
        # several ranks of a node: each listens on its own port (0: each picks a free one)
        self.port = self.cfg.port + local_rank if self.cfg.port else 0
        self.thread = None
        self.policy, self._training = None, False  # (start: the policy and its own mode)
        self.url: str | None = None
        registry.publish(self.run_dir, rank, None, None, "waiting_for_weights")
        _current = self

    @classmethod
    def announce(cls, recipe, run_dir: Path, checkpoint: Path) -> JobServer | None:
        """This rank's server-to-be (of `checkpoint`'s processor), or None when the recipe serves
        nothing."""
        if not recipe.generation.server.enabled:
            return None
        rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        return cls(recipe, run_dir, checkpoint, rank, local)

    @property
    def engine(self):
        return self.thread.served.engine

    def start(self, policy, version: int) -> str:
        """Serve `policy` (its weights are version `version`); returns the URL clients use."""
        from rlflow.serve.runner import ServerThread, served_engine

        self.policy, self._training = policy, policy.core.training
        gen = self.recipe.generation
        recipe = dataclasses.replace(
            self.recipe, generation=dataclasses.replace(gen, cuda_graphs=False)
        )
        served = served_engine(policy, self.checkpoint, recipe, self.recipe.model.checkpoint)
        served.engine.weight_version = version
        cfg = self.cfg
        self.thread = ServerThread(
            served, cfg.host, self.port, cfg.max_connections, cfg.idle_timeout_s
        ).start()
        host = self.thread.host
        if host in ("0.0.0.0", "::", ""):  # every interface: other nodes reach it by name
            host = socket.getfqdn()
        self.url = f"http://{host}:{self.thread.port}/v1"
        self._publish("ready")
        return self.url

    @contextmanager
    def paused(self, version: int):
        """The server waits while the block runs, and serves `version` after it."""
        if self.thread is None:
            yield
            return
        engine = self.engine
        for request in engine.pending():  # answered first: a busy trainer starves no client
            request.wait()
        entered, gate = threading.Event(), threading.Event()

        def hold() -> None:  # runs in the engine's thread, between two steps
            entered.set()
            gate.wait()

        updater = threading.Thread(
            target=engine.update_weights, args=(hold, version), name="rlflow-serve-pause"
        )
        updater.start()
        entered.wait()
        changed = version != engine.weight_version
        # The server serves in eval mode; the trainer gets its model back in its own mode (a
        # training forward in the server would count toward MoE's load-balancing loss).
        self.policy.core.train(self._training)
        try:
            yield
        finally:
            self.policy.core.eval()
            gate.set()
            updater.join()
        if changed:
            self._publish("ready")

    def stop(self) -> None:
        global _current
        if self.thread is not None:
            self.thread.stop()
            self.policy.core.train(self._training)
        self._publish("stopped")
        _current = None

    def fail(self, error: str) -> None:
        self._publish("failed", error)

    def _publish(self, state: str, error: str | None = None) -> None:
        version = self.engine.weight_version if self.thread is not None else None
        registry.publish(self.run_dir, self.rank, self.url, version, state, error)


def mark_failed(error: str) -> None:
    """This rank is failing: its record (if it has a server) says so, naming `error`."""
    if _current is not None:
        try:
            _current.fail(error)
        except OSError:
            pass  # the run directory is gone: nothing waits on it either


def wait_for_servers(recipe, run_dir: Path, ranks: list[int]) -> list[registry.ServerRecord]:
    """For a client of the job (an environment, an evaluation): the records of `ranks` once all
    serve, bounded by `generation.server.ready_timeout_s` (rlflow/serve/registry.py)."""
    return registry.wait_ready(Path(run_dir), ranks, recipe.generation.server.ready_timeout_s)
