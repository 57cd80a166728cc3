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
