"""The server inside `rlflow train` (generation.server.enabled), as a user runs it: a real CPU
training run of the tiny recipe serves its policy; a client finds the URL in the run directory
and gets a completion through the `openai` client, generated with the trainer's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from openai import OpenAI

from rlflow.serve import registry
from tests.serve.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
CONSOLE_SCRIPT = str(Path(sys.executable).with_name("rlflow"))
STEPS = 1
# Short steps, no reference model, no warm start, no checkpoint: the run only has to reach
# weight version STEPS (the trainer then stops for good at `logged<STEPS>`: RLFLOW_TEST_HANG), so the
# version the server answers with is known.
QUICK = [
    f"grpo.max_num_steps={STEPS + 1}", "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2", "grpo.val_period=0", "grpo.val_at_start=false",
    "grpo.val_at_end=false", "warm_start.num_steps=0", "loss.kl_penalty=0",
    "checkpointing.save_period=100", "logging.progress_bar=false", "data.train.num_samples=16",
    "generation.server.enabled=true", "generation.server.port=0",
    "generation.server.max_rows=2", "generation.server.context_tokens=256",
]  # fmt: skip


def test_a_training_run_serves_its_weights_at_the_url_in_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    log = (tmp_path / "train.log").open("w")
    train = subprocess.Popen(
        [CONSOLE_SCRIPT, "train", str(RECIPE), *QUICK, "--run-dir", str(run_dir)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        env={**clean, "PYTHONUNBUFFERED": "1", "RLFLOW_TEST_HANG": f"0:logged{STEPS}"},
    )  # fmt: skip
    try:
        [first] = registry.wait_ready(run_dir, [0], timeout_s=600)
        assert first.url.startswith("http://127.0.0.1:") and first.url.endswith("/v1")

        def at_version() -> bool:  # the trainer holds version STEPS for good once it logged it
            assert train.poll() is None, (tmp_path / "train.log").read_text()
            return registry.read(run_dir, 0).weight_version == STEPS

        wait_until(at_version, f"weight version {STEPS}", timeout=600)
        client = OpenAI(base_url=first.url, api_key="unused", max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(
            model="builtin:tiny-qwen25vl", messages=[{"role": "user", "content": "How many?"}],
            max_tokens=4, seed=0,
        )  # fmt: skip
        reply = raw.parse()
        assert raw.headers["x-rlflow-weight-version"] == str(STEPS)
        assert reply.model_extra["weight_version"] == STEPS
        assert reply.choices[0].message.model_extra["generation_token_ids"]
        record = json.loads(registry.record_path(run_dir, 0).read_text())
        assert record["state"] == "ready" and record["url"] == first.url
    finally:
        train.kill()
        train.wait()
        log.close()


def test_a_pause_holds_requests_and_they_get_the_new_version(
    tiny_policy, tiny_ckpt, tiny_processor, tmp_path
):
    """In-process, on the shared tiny policy: inside `paused(1)` the trainer has the model (in
    its own mode) and a request waits in the queue; after it, the request is answered with
    version 1 and the registry says so."""
    from dataclasses import replace

    from rlflow.generation.base import SamplingParams
    from rlflow.serve.job import JobServer
    from rlflow.serve.requests import Request
    from tests.tiny import base_recipe, make_prompt

    recipe = base_recipe()
    gen = recipe.generation
    server_keys = replace(gen.server, enabled=True, port=0, max_rows=2, context_tokens=256)
    recipe = replace(recipe, generation=replace(gen, server=server_keys))
    server = JobServer(recipe, tmp_path, tiny_ckpt, rank=0, local_rank=0)
    tiny_policy.core.train(True)  # a trainer's model (the shared fixture's is frozen)
    try:
        server.start(tiny_policy, 0)
        assert registry.read(tmp_path, 0).state == "ready" and not tiny_policy.core.training
        prompt = make_prompt(tiny_processor, "text", "How many?")
        request = Request(
            prompt, list(prompt.token_ids), SamplingParams(3, 1.0, 1.0, 0, 0, (), True), [0]
        )
        with server.paused(1):
            assert tiny_policy.core.training  # the trainer's model, in its own mode
            server.engine.submit(request)
            assert not request.done and not server.engine.batch.rows  # the engine is held
        request.wait()
        assert request.error is None and request.weight_version == 1
        assert len(request.choices[0].token_ids) == 3
        assert registry.read(tmp_path, 0).weight_version == 1
    finally:
        server.stop()
        trained = tiny_policy.core.training  # stop() handed it back in the trainer's mode
        tiny_policy.core.eval()
    assert registry.read(tmp_path, 0).state == "stopped" and trained
