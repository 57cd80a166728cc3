"""A NeMo Gym task that fails (rlflow/train/gym/source.py): the agent hangs past
`environment.task_timeout_s`, answers something that is not JSON, or its server died. Each is
a failed task with its reason, never a failed run; the episodes beside it train.

The agent here is a real HTTP server in a process of its own (the standard library's; Gym's
own agent cannot be made to hang or garble on cue), posted to by rlflow's real collection code;
a real Gym agent runs in tests/train/test_train_gym.py. No model: the answers carry their own
token ids.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlflow.recipe.load import load_recipe
from rlflow.train.gym.episodes import Episodes
from rlflow.train.gym.servers import GymServers
from rlflow.train.gym.trajectory import TaskFailed

ROOT = Path(__file__).resolve().parents[2]
GYM_TOOL = ROOT / "recipes" / "tiny-qwen3-gym-tool-1n1g-cpu.yaml"

AGENT = textwrap.dedent(
    """
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    OK = {"reward": 1.0, "response": {"output": [{
        "type": "message", "role": "assistant", "content": [],
        "prompt_token_ids": [1, 2], "generation_token_ids": [3, 4],
        "generation_log_probs": [-0.5, -0.5]}]}}

    class Agent(BaseHTTPRequestHandler):
        def do_POST(self):
            row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            what = row["responses_create_params"]["input"]
            if what == "hang":
                time.sleep(3600)  # the test kills this process
            body = b"<html>not json" if what == "garble" else json.dumps(OK).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Agent)
    print(server.server_address[1], flush=True)
    server.serve_forever()
    """
)


@pytest.fixture
def gym(tmp_path):
    """The leader's Episodes posting to the agent process above, with a task timeout of 1 s."""
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    port = int(agent.stdout.readline())
    recipe = load_recipe(GYM_TOOL, ["environment.task_timeout_s=1"]).recipe
    servers = GymServers(None, [], tmp_path, 1)
    servers.processes = {"agent": agent}
    yield Episodes(recipe.environment, f"http://127.0.0.1:{port}", servers, tmp_path)
    agent.kill()
    agent.wait()


def post(episodes: Episodes, *inputs: str) -> list:
    return episodes.run([{"responses_create_params": {"input": text}} for text in inputs], 0)


def test_a_hung_or_garbled_task_fails_alone(gym):
    ok, hung, garbled = post(gym, "fine", "hang", "garble")
    assert ok.reward == 1.0 and ok.completion.token_ids == [3, 4]
    assert isinstance(hung, TaskFailed) and hung.reason == "timeout"
    assert hung.detail == "no answer within 1 s"
    assert isinstance(garbled, TaskFailed) and garbled.reason == "malformed_json"
    assert "not JSON" in garbled.detail


def test_a_dead_agent_fails_its_tasks_naming_it(gym):
    gym.servers.processes["agent"].kill()
    gym.servers.processes["agent"].wait()
    [failed] = post(gym, "fine")
    assert isinstance(failed, TaskFailed) and failed.reason == "server_died"
    assert failed.detail == "dead: ['agent']"
