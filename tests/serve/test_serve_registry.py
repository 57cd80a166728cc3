"""RUN_DIR/servers (rlflow/serve/registry.py): atomic records, and waits that end when the
servers are ready, at once when a rank failed (naming the error), and at a bounded timeout
naming the rank, its URL and its last state. No model: the records are what the ranks write."""

from __future__ import annotations

import threading

import pytest

from rlflow.errors import RlflowError
from rlflow.job import files
from rlflow.serve import registry
from rlflow.serve.job import JobServer, mark_failed
from tests.tiny import base_recipe


def _in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn)
    thread.start()
    return thread


def test_a_record_is_replaced_whole_and_read_back(tmp_path):
    path = registry.publish(tmp_path, 3, None, None, "waiting_for_weights")
    assert path == tmp_path / "servers" / "rank-3.json"
    registry.publish(tmp_path, 3, "http://node7:8003/v1", 5, "ready")
    record = registry.read(tmp_path, 3)
    assert (record.rank, record.url, record.weight_version, record.state) == (
        3, "http://node7:8003/v1", 5, "ready",
    )  # fmt: skip
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank-3.json"]  # no temporaries
    assert registry.read(tmp_path, 4) is None
    assert [r.rank for r in registry.read_all(tmp_path)] == [3]
    with pytest.raises(ValueError, match="not one of"):
        registry.publish(tmp_path, 3, None, None, "serving")


def test_the_wait_ends_when_every_rank_is_ready(tmp_path):
    registry.publish(tmp_path, 0, "http://a:1/v1", 0, "ready")
    registry.publish(tmp_path, 1, None, None, "waiting_for_weights")
    records = []
    thread = _in_thread(lambda: records.extend(registry.wait_ready(tmp_path, [0, 1], 600)))
    registry.publish(tmp_path, 1, "http://b:2/v1", 0, "ready")
    thread.join()
    assert [r.url for r in records] == ["http://a:1/v1", "http://b:2/v1"]


def test_a_first_sync_failure_ends_the_wait_at_once_naming_the_error(tmp_path):
    """The rank publishes `failed` (what rlflow/train/main.py does on any error): a waiter with
    the default 600 s timeout returns now, with the sync's error."""
    recipe = base_recipe()
    server = JobServer(recipe, tmp_path, tmp_path / "model", rank=1, local_rank=1)
    assert registry.read(tmp_path, 1).state == "waiting_for_weights"
    assert server.port == 8001  # generation.server.port (8000) + the local rank
    failure = "RuntimeError: injected failure on rank 1 during sync0"
    errors = []

    def wait():
        try:
            registry.wait_ready(tmp_path, [1], timeout_s=600)
        except RlflowError as exc:
            errors.append(exc)

    thread = _in_thread(wait)
    mark_failed(failure)
    thread.join()
    [diagnostic] = errors[0].diagnostics
    assert diagnostic.code == "serve.rank-failed"
    assert "rank 1" in diagnostic.message and "first weight load/sync failed" in diagnostic.message
    assert failure in diagnostic.message


def test_a_job_that_died_ends_the_wait_with_the_launchers_failure(tmp_path):
    registry.publish(tmp_path, 0, None, None, "waiting_for_weights")
    status = files.attempt_status(tmp_path, 0)
    status.mkdir(parents=True)
    (status / files.FIRST_FAILURE).write_text(files.Failure("1", "rank 2: CUDA OOM", "n3").text())
    for ranks in ([0], [1]):  # rank 1 never wrote a record: the job died first
        with pytest.raises(RlflowError) as caught:
            registry.wait_ready(tmp_path, ranks, timeout_s=600)
        assert caught.value.diagnostics[0].code == "serve.job-failed"
        assert "rank 2: CUDA OOM" in caught.value.diagnostics[0].message


def test_the_timeout_names_the_rank_its_url_and_its_last_state(tmp_path):
    registry.publish(tmp_path, 0, "http://a:1/v1", 3, "ready")
    registry.publish(tmp_path, 2, None, None, "waiting_for_weights")
    with pytest.raises(RlflowError) as caught:
        registry.wait_ready(tmp_path, [0, 2, 5], timeout_s=0.05)
    [diagnostic] = caught.value.diagnostics
    assert diagnostic.code == "serve.ready-timeout"
    assert "0.05 s (generation.server.ready_timeout_s)" in diagnostic.message
    assert "rank 2: URL none yet, last state waiting_for_weights" in diagnostic.message
    assert "rank 5: no record" in diagnostic.notes[0]


def test_a_damaged_record_is_an_error_naming_the_file(tmp_path):
    path = registry.record_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(RlflowError, match="rank-0.json is not a server record"):
        registry.read(tmp_path, 0)
