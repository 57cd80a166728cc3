"""A server on one machine: load the policy, start the engine, run uvicorn (`rlflow serve`, the
tests and the benchmark use the same pieces).

uvicorn serves in its own thread here (`ServerThread`): the caller keeps the engine at hand
(weight updates, statistics) and stops the server by event, not by signal.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from rlflow.serve.app import Served, make_app
from rlflow.serve.batch import RunningBatch
from rlflow.serve.engine import ServingEngine
from rlflow.serve.prompts import ChatEncoder
from rlflow.serve.tensor_parallel import Follower


def served_engine(policy, checkpoint: Path, recipe, model_name: str, plans=None) -> Served:
    """The policy's engine and the checkpoint's processor, sized by `generation.server`.
    `plans`: a tensor-parallel engine's PlanSender (rlflow/serve/tensor_parallel.py)."""
    server, gen = recipe.generation.server, recipe.generation
    encoder = ChatEncoder(checkpoint)
    engine = ServingEngine(
        policy, encoder.pad_token_id, **_batch_sizes(recipe),
        on_weight_update=server.on_weight_update, max_prefill_tokens=server.max_prefill_tokens,
        plans=plans,
    )  # fmt: skip
    return Served(engine, encoder, model_name, default_max_tokens=gen.max_new_tokens)


def following_engine(policy, pad_token_id: int, recipe, group) -> Follower:
    """A tensor-parallel engine's other rank: the leader's batch, run by its plans."""
    return Follower(RunningBatch(policy, pad_token_id, **_batch_sizes(recipe)), group)


def _batch_sizes(recipe) -> dict:
    server, gen = recipe.generation.server, recipe.generation
    return dict(
        max_rows=server.max_rows, context_tokens=server.context_tokens,
        cache_tokens=gen.kv_cache_tokens, cuda_graphs=gen.cuda_graphs,
        compile_decode=gen.compile_decode,
    )  # fmt: skip


_SPARE_FILES = 256  # beside the connections: the model's files, logs, the engine's pipes


def raise_open_files(wanted: int) -> int:
    """Raise this process's open-file soft limit to `wanted` (at most the hard limit): a
    connection is a file, and the usual soft limit of 1024 would refuse clients (EMFILE) long
    before `generation.server.max_connections` does. Returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


class ServerThread:
    """uvicorn on a bound socket, in a thread; `url` once `start()` returned."""

    def __init__(
        self, served: Served, host: str, port: int, max_connections: int, idle_timeout_s: int
    ):
        import uvicorn

        self.served = served
        raise_open_files(max_connections + _SPARE_FILES)
        self.socket = socket.create_server((host, port), backlog=2048)
        self.host, self.port = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            make_app(served), log_level="warning", limit_concurrency=max_connections,
            timeout_keep_alive=idle_timeout_s, access_log=False, http=_idle_closing_h11(),
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="rlflow-serve-http", daemon=True)
        self._failed: BaseException | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise RuntimeError(f"the HTTP server did not start: {self._failed}")
        return self

    def _serve(self) -> None:
        import asyncio

        async def run():  # uvicorn's Server._serve, with an event once it listens
            server, config = self.server, self.server.config
            if not config.loaded:
                config.load()
            server.lifespan = config.lifespan_class(config)
            await server.startup(sockets=[self.socket])
            self._ready.set()
            if not server.should_exit:
                await server.main_loop()
            if server.started:
                await server.shutdown(sockets=[self.socket])

        try:
            asyncio.run(run())
        except BaseException as exc:  # reported by start(), or after it by wait()
            self._failed = exc
        finally:
            self._ready.set()

    def wait(self) -> None:
        """Until the server stops (Ctrl-C in the main thread stops it: see `stop`)."""
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()
        self.served.close()
        self.socket.close()


def _idle_closing_h11():
    """uvicorn's h11 protocol, closing also a connection that sends nothing for the keep-alive
    timeout (uvicorn times a connection out only after a response): idle clients cannot hold
    the server's connection slots (`generation.server.max_connections`) for ever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdleClosingH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    return IdleClosingH11
