"""The server's life beside the engine's: weight versions across an update (finished on the old
weights and marked, or refused), a client that goes away mid-generation, idle connections."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL, wait_until

LONG = dict(
    model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=900, seed=1,
    extra_body={"ignore_eos": True},
)  # fmt: skip


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.fixture
def engine(server):
    engine = server.served.engine
    yield engine
    engine.on_weight_update = "finish_old"


def test_a_request_spanning_an_update_finishes_on_the_old_weights_marked(client, engine):
    old = engine.weight_version
    thread, out = _in_thread(lambda: client.chat.completions.with_raw_response.create(**LONG))
    wait_until(lambda: engine.batch.rows, "the request to run")
    applied = []
    engine.update_weights(lambda: applied.append(engine.batch.rows == []), old + 1)
    thread.join()
    raw = out["value"]
    body = json.loads(raw.text)
    assert raw.headers["x-rlflow-weight-version"] == str(old) and body["weight_version"] == old
    assert body["weight_version_superseded"] is True
    assert len(body["choices"][0]["message"]["generation_token_ids"]) == 900
    assert applied == [True]  # the update ran once the old rows had drained
    after = client.chat.completions.with_raw_response.create(**{**LONG, "max_tokens": 2})
    assert after.headers["x-rlflow-weight-version"] == str(old + 1)
    assert "weight_version_superseded" not in json.loads(after.text)


def test_a_weight_update_that_fails_ends_at_once_naming_the_cause(client, engine):
    """An update whose apply raises is handed back to update_weights' caller (the trainer's
    weight refresh), not retried in the engine's loop while the caller waits for good."""
    from rlflow.errors import RlflowError

    old = engine.weight_version

    def broken():
        raise OSError("the weights' file went away")

    with pytest.raises(RlflowError) as caught:
        engine.update_weights(broken, old + 1)
    [diagnostic] = caught.value.diagnostics
    assert diagnostic.code == "serve.weight-update"
    assert f"version {old + 1}: OSError: the weights' file went away" in diagnostic.message
    after = client.chat.completions.create(**{**LONG, "max_tokens": 2})
    assert after.model_extra["weight_version"] == old  # still serving, on the old weights


def test_a_request_spanning_an_update_is_refused_when_the_recipe_says_so(client, engine):
    engine.on_weight_update = "refuse"
    old = engine.weight_version
    thread, out = _in_thread(lambda: client.chat.completions.create(**LONG))
    wait_until(lambda: engine.batch.rows, "the request to run")
    engine.update_weights(None, old + 1)
    thread.join()
    error = out["error"]
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503
    assert error.body["code"] == "weight_update" and "send it again" in error.body["message"]
    again = client.chat.completions.create(**{**LONG, "max_tokens": 2})
    assert again.model_extra["weight_version"] == old + 1


def test_a_client_that_goes_away_frees_its_row_at_once(server, engine):
    cancelled, tokens = engine.stats.cancelled, engine.stats.tokens
    fields = {k: v for k, v in LONG.items() if k != "extra_body"}
    body = json.dumps(fields | LONG["extra_body"]).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(head + body)
        wait_until(lambda: engine.batch.rows, "the request to run")
    wait_until(lambda: not engine.batch.rows, "its row to leave the batch")
    assert engine.stats.cancelled == cancelled + 1
    assert engine.stats.tokens - tokens < 900  # it never ran to its max_tokens
    assert engine.batch.cache.free_blocks == engine.batch.cache.blocks - 1  # every block back


def test_idle_connections_are_bounded_and_the_engine_keeps_serving(client, server, engine):
    """More idle connections than the server takes: requests beyond its slots get a 503 at once
    (never a hang); the idle ones are closed after idle_timeout_s, and serving goes on."""
    limit = server.server.config.limit_concurrency
    running, out = _in_thread(lambda: client.chat.completions.create(**{**LONG, "max_tokens": 300}))
    wait_until(lambda: engine.batch.rows, "a request to run")
    idle = [socket.create_connection((server.host, server.port)) for _ in range(limit + 50)]
    try:
        wait_until(lambda: len(server.server.server_state.connections) >= limit, "the flood")
        refused = httpx.get(f"{server.url}/health", timeout=30)
        assert refused.status_code == 503
        running.join()
        assert len(out["value"].choices[0].message.model_extra["generation_token_ids"]) == 300
        for sock in idle:  # the server closes them: recv sees the end of the stream
            sock.settimeout(120)
            assert sock.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
    assert client.chat.completions.create(**{**LONG, "max_tokens": 2}).choices


def test_the_server_raises_its_open_file_soft_limit_for_its_connections():
    """Each idle client is an open file: the server lifts the soft limit (usually 1024) to
    max_connections + spare at start, up to the hard limit (benchmarks/serve_idle_connections.py
    holds 10,000 idle connections against `rlflow serve`)."""
    import resource

    from rlflow.serve.runner import raise_open_files

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
        assert raise_open_files(want) == want
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == want
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
