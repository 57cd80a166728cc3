"""`rlflow serve` through its console script, as a user runs it: the built-in tiny model comes up,
prints its URL, answers an OpenAI client, and stops cleanly on Ctrl-C (SIGINT)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = str(ROOT / ".venv" / "bin" / "rlflow")


def test_rlflow_serve_answers_an_openai_client_and_stops_on_ctrl_c(tmp_path):
    log = tmp_path / "stderr.log"  # a file, not a pipe: a full pipe would block the server
    server = subprocess.Popen(
        [RLFLOW, "serve", "--port", "0", "generation.server.max_rows=2",
         "generation.server.context_tokens=256"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        # its line once it listens (megatron-bridge prints its loading progress before)
        ready = next((line for line in server.stdout if line.startswith("rlflow serve:")), "")
        assert ready.startswith("rlflow serve: ready at http://127.0.0.1:"), ready + log.read_text()
        url = ready.split()[4]
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="builtin:tiny-qwen25vl", messages=[{"role": "user", "content": "How many?"}],
            max_tokens=4, seed=0,
        )  # fmt: skip
        assert reply.choices[0].message.model_extra["generation_token_ids"]
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=120)
    stderr = log.read_text()
    assert server.returncode == 0, stderr
    assert "Traceback" not in stderr and "rlflow serve: stopping" in stderr


def test_serve_help_imports_no_torch():
    code = (
        "import sys\nfrom rlflow.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'fastapi', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_rlflow_serve_splits_the_model_over_tensor_parallel_ranks(hybrid_policy, tmp_path):
    """`parallelism.tensor_parallel_size=2`: two local ranks of the tiny Nemotron-H, rank 0
    serving; a greedy answer's tokens are the one-rank server's. Ctrl-C (SIGINT to the
    terminal's process group) stops the server, and its last plan sends the other rank home."""
    import os

    from rlflow.serve.runner import ServerThread, served_engine
    from tests.tiny import base_recipe

    policy, _, checkpoint = hybrid_policy
    messages = [{"role": "user", "content": "How many red squares are there?"}]

    def tokens(url: str) -> list[int]:
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="hybrid", messages=messages, max_tokens=12, temperature=0.0
        )
        return reply.choices[0].message.model_extra["generation_token_ids"]

    one = ServerThread(served_engine(policy, checkpoint, base_recipe(), "hybrid"), "127.0.0.1",
                       0, 8, 30).start()  # fmt: skip
    try:
        expected = tokens(f"{one.url}/v1")
    finally:
        one.stop()
    log = tmp_path / "stderr.log"
    server = subprocess.Popen(
        [RLFLOW, "serve", str(checkpoint), "parallelism.tensor_parallel_size=2", "--port", "0",
         "--model-name", "hybrid"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=tmp_path,
        start_new_session=True,
    )  # fmt: skip
    try:
        ready = next((line for line in server.stdout if line.startswith("rlflow serve:")), "")
        assert "tensor parallel over 2 ranks" in ready, ready + log.read_text()
        assert tokens(ready.split()[4]) == expected
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.communicate(timeout=120)
    stderr = log.read_text()
    assert server.returncode == 0, stderr
    assert "Traceback" not in stderr and "rlflow serve: stopping" in stderr


def test_rlflow_serve_refuses_a_split_it_does_not_serve(tmp_path):
    result = subprocess.run(
        [RLFLOW, "serve", "builtin:tiny-qwen3-moe", "parallelism.expert_parallel_size=2"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "error[serve.parallel]" in result.stderr and "Traceback" not in result.stderr
    assert "set parallelism.expert_parallel_size=1" in result.stderr
