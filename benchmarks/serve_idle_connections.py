"""10,000 idle connections against `rlflow serve` (issue 31's "bad input"): bounded, and the
engine keeps serving.

The server (the built-in tiny model on the CPU, `generation.server.max_connections` 1024,
`idle_timeout_s` 5) runs as users run it, through its console script. This process opens
--connections TCP connections that send nothing, then measures:

- accepted: how many the server accepted (it raises its open-file soft limit to
  max_connections + 256 at start, so the kernel's default 1024 does not refuse them first);
- refused_health: a request past max_connections gets an immediate 503 (seconds to answer);
- closed_s: seconds until the server has closed every idle connection (idle_timeout_s);
- served_after: a chat completion through the `openai` client once they are gone.

The test suite runs the same path with max_connections + 50 idle sockets
(tests/serve/test_serve_lifecycle.py::test_idle_connections_are_bounded_and_the_engine_keeps_serving);
10,000 sockets need 10,000 open files on each side, more than a test process may hold.

    uv run python benchmarks/serve_idle_connections.py --connections 10000 --out /tmp/idle
"""

from __future__ import annotations

import argparse
import json
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RLFLOW = str(Path(sys.executable).with_name("rlflow"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.connections + 512), hard))
    log = (args.out / "server.log").open("w")
    server = subprocess.Popen(
        [RLFLOW, "serve", "--port", "0", "generation.server.context_tokens=256"],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    try:
        ready = next(line for line in server.stdout if line.startswith("rlflow serve:"))
        url = ready.split()[4]
        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        results = measure(host, int(port), url, args.connections)
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C: `rlflow serve` stops cleanly (exit 0)
        server.wait(timeout=120)
    results["server_exit"] = server.returncode
    text = json.dumps(results, indent=2)
    print(text)
    (args.out / "results.json").write_text(text + "\n")


def measure(host: str, port: int, url: str, count: int) -> dict:
    import httpx
    from openai import OpenAI

    started = time.monotonic()
    idle = []
    for _ in range(count):
        idle.append(socket.create_connection((host, port)))
    opened_s = time.monotonic() - started
    asked = time.monotonic()
    health = httpx.get(f"{url.removesuffix('/v1')}/health", timeout=60)
    refused_s = time.monotonic() - asked
    selector = selectors.DefaultSelector()
    for sock in idle:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    open_left, waited = len(idle), time.monotonic()
    while open_left and time.monotonic() - waited < 120:
        for key, _ in selector.select(timeout=1):
            try:
                if key.fileobj.recv(1) == b"":
                    selector.unregister(key.fileobj)
                    open_left -= 1
            except (ConnectionResetError, BlockingIOError):
                selector.unregister(key.fileobj)
                open_left -= 1
    closed_s = time.monotonic() - waited
    for sock in idle:
        sock.close()
    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="builtin:tiny-qwen25vl", messages=[{"role": "user", "content": "How many?"}],
        max_tokens=4, seed=0,
    )  # fmt: skip
    return {
        "connections": count,
        "opened_s": round(opened_s, 2),
        "refused_health_status": health.status_code,
        "refused_health_s": round(refused_s, 3),
        "still_open_after_wait": open_left,
        "closed_s": round(closed_s, 2),
        "served_after": bool(reply.choices[0].message.model_extra["generation_token_ids"]),
    }


if __name__ == "__main__":
    main()
