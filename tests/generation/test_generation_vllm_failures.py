"""The vLLM backend's failure rules, with the real worker: clear start-up errors, fast failure when
the worker dies, a run that stops after a failed weight refresh, and no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from tests.generation.conftest import leftover_weight_files
from tests.tiny import greedy, make_prompt


def process_gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper that is not us counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds  # a bound against hanging, not a speed requirement
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.2)
    return False


def test_missing_environment_is_an_error_naming_the_setup_command(
    tiny_policy, vllm_gen_cfg, tmp_path
):
    from rlflow.generation.vllm.client import VLLMGeneration

    cfg = replace(vllm_gen_cfg, vllm=replace(vllm_gen_cfg.vllm, env_root=str(tmp_path / "envs")))
    with pytest.raises(RlflowError) as missing:
        VLLMGeneration(tiny_policy, cfg, tmp_path / "run", max_model_len=1024)
    text = str(missing.value)
    assert "vllm.env-missing" in text and "is not built" in text
    assert "rlflow setup-env vllm" in text and "slurm.setup_command" in text

    from rlflow.envs.spec import vllm_spec

    vllm_spec(cfg.vllm).path(cfg.vllm.env_root).mkdir(parents=True)  # a build that died half-way
    with pytest.raises(RlflowError, match="was not finished"):
        VLLMGeneration(tiny_policy, cfg, tmp_path / "run", max_model_len=1024)


def test_broken_environment_fails_at_start_with_the_worker_log(tiny_policy, vllm_gen_cfg, tmp_path):
    """A finished-looking environment whose vLLM is gone: the worker's ImportError is shown."""
    import shutil

    from rlflow.envs.spec import MARKER, vllm_spec
    from rlflow.generation.vllm.client import VLLMGeneration

    cfg = replace(vllm_gen_cfg, vllm=replace(vllm_gen_cfg.vllm, env_root=str(tmp_path / "envs")))
    spec = vllm_spec(cfg.vllm)
    env_dir = spec.path(cfg.vllm.env_root)
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").symlink_to(shutil.which("python3.11"))  # Python, but no vLLM
    (env_dir / MARKER).write_text(json.dumps({"digest": spec.digest}))
    with pytest.raises(RlflowError) as broken:
        VLLMGeneration(tiny_policy, cfg, tmp_path / "run", max_model_len=1024)
    text = str(broken.value)
    assert "vllm.start-failed" in text and "No module named 'vllm'" in text
    assert "--rebuild" in text


@pytest.mark.timeout(300)  # with a one-hour request timeout, only death detection ends this early
def test_a_killed_worker_fails_the_next_call_with_its_log_tail(
    start_vllm, tiny_policy, tiny_processor
):
    eos = tiny_processor.tokenizer.eos_token_id
    prompt = make_prompt(tiny_processor, "image", "How many?", seed=1)
    backend = start_vllm(tiny_policy, request_timeout_s=3600)
    backend.generate([prompt], greedy(4, eos))
    os.kill(backend.pid, signal.SIGKILL)
    with pytest.raises(RlflowError) as failed:
        backend.generate([prompt], greedy(4, eos))
    text = str(failed.value)
    assert "vllm.worker-failed" in text and "exit code -9" in text
    assert "rlflow-vllm-worker: ready" in text  # the log tail is part of the error
    with pytest.raises(RlflowError, match="vllm.unusable"):
        backend.refresh_weights()


def test_a_refresh_that_loads_other_weights_fails_the_fingerprint_check(
    start_vllm, tiny_policy, tiny_processor, monkeypatch
):
    """Refresh 2's file differs from the export in one sampled element (vLLM loads it without
    complaint): the fingerprint read back from vLLM's own weights stops the backend. Refresh 1
    (at start) passed the same check, and vLLM says which version it generated with. The
    stopped backend refuses to generate and left no weight file behind. A refresh that vLLM
    itself refuses (a tensor cut short) stops the backend the same way (`_fail`): that path,
    with vLLM's own error and the worker gone, is test_generation_vllm_grpo.py's
    test_a_failed_weight_refresh_stops_the_run, through the trainer."""
    eos = tiny_processor.tokenizer.eos_token_id
    prompt = make_prompt(tiny_processor, "text", "How many?", seed=1)
    backend = start_vllm(tiny_policy)
    assert backend.weight_version == 0
    backend.generate([prompt], greedy(4, eos))
    monkeypatch.setenv("RLFLOW_TEST_TEAR", "0:vllm-refresh2")
    with pytest.raises(RlflowError) as failed:
        backend.refresh_weights(1)
    text = str(failed.value)
    assert "vllm.weight-fingerprint" in text
    assert "after the weight refresh of version 1, vLLM's weights are not the trainer's" in text
    assert "1 tensors differ" in text
    assert not backend.worker.alive()
    assert not leftover_weight_files(backend)
    with pytest.raises(RlflowError, match="its weights may be stale"):
        backend.generate([prompt], greedy(4, eos))


_ORPHAN_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from rlflow.generation.vllm.process import WorkerProcess
python, config, log = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
worker = WorkerProcess(Path(python), config, log, dict(os.environ), startup_timeout_s=600)
print(worker.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(600)
def test_the_worker_does_not_outlive_a_killed_trainer(vllm_env, tiny_ckpt, tmp_path):
    """SIGKILL to the trainer (no cleanup runs): the kernel's parent-death signal ends the worker."""
    from rlflow.generation.vllm.client import MEDIA_LIMITS

    config = {
        "model": str(tiny_ckpt),
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_seqs": 4,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.3,
        "limit_mm_per_prompt": MEDIA_LIMITS,
        "seed": 0,
    }
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _ORPHAN_SCRIPT,
            str(vllm_env / "bin" / "python"),
            json.dumps(config),
            str(tmp_path / "worker.log"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        worker_pid = int(trainer.stdout.readline())
        assert not process_gone(worker_pid)
    finally:
        trainer.kill()
        trainer.wait()
    assert wait_gone(worker_pid), (tmp_path / "worker.log").read_text()[-2000:]


@pytest.mark.timeout(300)
def test_a_worker_that_stops_answering_is_stopped_after_the_request_timeout(
    start_vllm, tiny_policy, tiny_processor
):
    """A hung (not dead) worker: SIGSTOP it; the call ends at request_timeout_s, the worker by SIGKILL."""
    eos = tiny_processor.tokenizer.eos_token_id
    prompt = make_prompt(tiny_processor, "text", "How many?", seed=1)
    backend = start_vllm(tiny_policy, request_timeout_s=5)
    os.kill(backend.pid, signal.SIGSTOP)
    with pytest.raises(RlflowError, match="gave no answer to generate within 5 s; stopped it"):
        backend.generate([prompt], greedy(4, eos))
    assert not backend.worker.alive()
