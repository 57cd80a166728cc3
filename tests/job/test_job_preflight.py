"""In-job preflight checks that need no second node (rlflow/job/preflight.py); the gathering
across nodes and the exit codes run on the real cluster in test_job_recovery.py."""

from __future__ import annotations

from rlflow.job import preflight


def test_preflight_checks_name_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    monkeypatch.setenv(preflight.TEST_VISIBLE_GPUS_ENV, "node6:4,node7:3")
    assert preflight.check_gpus(4) == ["gpus: 3 GPUs visible, 4 requested"]
    assert preflight.check_gpus(3) == []
    monkeypatch.delenv("RLFLOW_PREFLIGHT_NOPE", raising=False)
    assert preflight.check_env(["HOME", "RLFLOW_PREFLIGHT_NOPE"]) == [
        "env: RLFLOW_PREFLIGHT_NOPE not set (preflight.required_env)"
    ]
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000004" / "model.pt").write_bytes(b"x" * 4096)
    assert preflight.checkpoint_bytes(tmp_path, None) == 4096
    assert preflight.check_disk(tmp_path, 4096, 0.0) == []
    [full] = preflight.check_disk(tmp_path, 2**60, 1.0)
    assert full.startswith("disk: ") and "a checkpoint needs 1073741824.0 GiB" in full
    assert preflight.check_gemm(64, 1e-5, "cpu") == []
