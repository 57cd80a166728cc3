"""One server for tests/serve, started once per session: the tiny checkpoint's policy behind the
real HTTP stack (uvicorn on a free port, in a thread of the test process, so tests can also
reach its engine: weight updates, statistics)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

MODEL = "tiny"
# Small on purpose: 4 rows and a 64-token prefill budget make requests queue, join the running
# batch and share it; a 1024-token context makes "too long" cheap to send.
SERVER_KEYS = dict(port=0, max_rows=4, context_tokens=1024, max_prefill_tokens=64)


@pytest.fixture(scope="session")
def server(tiny_policy, tiny_ckpt):
    from rlflow.serve.runner import ServerThread, served_engine
    from tests.tiny import base_recipe

    recipe = base_recipe()
    gen = recipe.generation
    gen = replace(gen, server=replace(gen.server, **SERVER_KEYS))
    served = served_engine(tiny_policy, tiny_ckpt, replace(recipe, generation=gen), MODEL)
    keys = gen.server
    thread = ServerThread(served, "127.0.0.1", 0, keys.max_connections, keys.idle_timeout_s).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    """Poll a state the server reaches (never a fixed sleep); fail naming it after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
