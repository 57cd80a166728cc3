"""The retry decision after an attempt (rlflow/job/attempts.py), on status files as the node
launchers write them."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest

from rlflow.job import attempts, files


def _status(tmp_path: Path, attempt: int, files: dict[str, str]) -> Path:
    status = tmp_path / "status" / f"attempt-{attempt}"
    status.mkdir(parents=True)
    for name, text in files.items():
        (status / name).write_text(text)
    return status


def _decide(tmp_path: Path, attempt: int, rc: int, files: dict[str, str], retries: int = 2):
    status = _status(tmp_path, attempt, files)
    args = Namespace(
        run_dir=str(tmp_path),
        status_dir=str(status),
        attempt=attempt,
        job_id="7",
        nodes="node[1-2]",
        rc=rc,
        max_requeues=1,
        max_failure_retries=retries,
    )
    decision, record = attempts.decide(args)
    attempts.append(tmp_path, record)
    return decision, record


def _started(*nodes: str) -> dict[str, str]:
    return {f"node-{i}.started": f"{n} pid 1\n" for i, n in enumerate(nodes)}


def _ended(*nodes: str) -> dict[str, str]:
    return {f"node-{i}.ended": f"{n} exit 0\n" for i, n in enumerate(nodes)}


def test_node_failures_are_retried_with_the_nodes_excluded_until_the_retries_run_out(tmp_path):
    both = {**_started("node1", "node2"), **_ended("node1", "node2")}
    hang = "77\nrank 3 (node2) made no progress for 300 s in phase `logprobs` at step 812\nnode2\n"
    assert _decide(tmp_path, 0, 77, {**both, "first-failure": hang})[0] == "retry node2"
    preflight_failures = {
        **both,
        "first-failure": "78\nrank 0 on node1 (node 0) failed preflight: gpus\nnode1\n",
        "failure-node-0": "78\nx\nnode1\n",
        "failure-node-1": "78\ny\nnode3\n",
    }
    assert _decide(tmp_path, 1, 78, preflight_failures)[0] == "retry node1,node2,node3"
    decision, record = _decide(tmp_path, 2, 137, _started("node4", "node5") | _ended("node4"))
    assert decision == "fail 137"
    assert record.reason.startswith("node node5 lost: its launcher never reported an exit")
    assert record.action == "stop: node-failure retries exhausted (slurm.max_failure_retries=2)"
    assert [r["attempt"] for r in files.read_attempts(tmp_path)] == [0, 1, 2]


def test_a_step_slurm_could_not_start_is_retried_without_blaming_a_node(tmp_path):
    decision, record = _decide(tmp_path, 0, 1, {})  # srun failed: no launcher ever started
    assert decision == "retry -" and record.bad_nodes == []
    assert record.reason == "Slurm could not start the step (srun exit 1)"


@pytest.mark.parametrize("code", [1, 2, 137])
def test_errors_of_the_run_itself_are_not_retried(tmp_path, code):
    failure = f"{code}\nrank 0 on node1 (node 0) exited with code {code}; log: x\nnode1\n"
    files = {**_started("node1"), **_ended("node1"), "first-failure": failure}
    decision, record = _decide(tmp_path, 0, code, files)
    assert (decision, record.outcome) == (f"fail {code}", "failed")
    assert record.action == "stop: not retried (a retry would fail the same way)"


def test_time_limit_requeues_are_counted_apart_from_node_failures(tmp_path):
    ok = {**_started("node1"), **_ended("node1"), "stopped-node-0": "x"}
    hang = {**_started("node1"), **_ended("node1"), "first-failure": "77\nh\nnode1\n"}
    assert _decide(tmp_path, 0, 77, hang)[0] == "retry node1"
    assert _decide(tmp_path, 1, 0, ok)[0] == "time-limit 0"  # the retry was no time-limit requeue
    assert _decide(tmp_path, 2, 0, ok)[0] == "time-limit 1"
    assert _decide(tmp_path, 3, 0, {**_started("node1"), **_ended("node1")})[0] == "done"


@pytest.mark.timeout(60)  # before rlflow/bounded.py, reading a named pipe waited forever
def test_status_files_that_are_pipes_are_never_waited_on(tmp_path):
    """The batch script's decision reads what the nodes wrote: a FIFO (or a link to /dev/zero)
    where a record belongs is skipped, never read (issue 36, item 4)."""
    import os

    status = _status(tmp_path, 0, _started("node1"))
    os.mkfifo(status / "node-1.started")  # node 1's launcher never reported an end
    os.mkfifo(status / "first-failure")
    (status / files.HEARTBEAT).mkdir()
    os.mkfifo(status / files.HEARTBEAT / "rank-0.json")
    (status / files.HEARTBEAT / "rank-1.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / files.ATTEMPTS)
    assert attempts.furthest_step(status) is None
    assert attempts.lost_nodes(status) == ["node1", "node-1"]
    assert files.first_failure(status) is None
    assert files.read_attempts(tmp_path) == []


def test_a_node_told_to_stop_is_lost_only_when_the_batch_script_found_it_so(tmp_path):
    """ "stopping on SIGTERM" and then Slurm's SIGKILL: told to stop, not lost. The same record
    and node-K.lost (the batch script saw its launcher die or freeze before its exit): lost."""
    stopping = {**_started("node1", "node2"), "node-0.ended": "node1 exit 0\n"}
    stopping["node-1.ended"] = "node2 stopping on SIGTERM\n"
    assert attempts.lost_nodes(_status(tmp_path, 0, stopping)) == []
    lost = {**stopping, "node-1.lost": "node2 no sign of life for 15 s\n"}
    assert attempts.lost_nodes(_status(tmp_path, 1, lost)) == ["node2"]
