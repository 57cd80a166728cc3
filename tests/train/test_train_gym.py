"""NeMo Gym as the rollout source (`environment.kind: gym`, rlflow/train/gym/): real Gym servers
(Gym's own example environments, from the `gym` extra) against rlflow's server on the tiny
Qwen3, trained through the console script (also one-step-off, with generation on a rank of its
own); Gym's answers turned into trajectories with loss
masks; servers that never come up or die end the run within the readiness timeout, naming them.

The tiny model's weights are random: it never emits a well-formed tool call, so the tool run
shows one-turn episodes (the plumbing, the rewards, the metrics); Gym's
example_multi_turn_gymnasium (a scripted user) gives real multi-turn episodes whatever the model
says, their turns continued token for token by rlflow's server. The token layout and the
continuity rule are also checked on Gym-shaped answers below.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.train.gym.trajectory import TaskFailed, convert, malformed_tool_calls
from rlflow.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = ROOT / ".venv" / "bin" / "rlflow"
GYM_TOOL = ROOT / "recipes" / "tiny-qwen3-gym-tool-1n1g-cpu.yaml"
MULTI_TURN = (
    "resources_servers/example_multi_turn_gymnasium/configs/example_multi_turn_gymnasium.yaml"
)
QUIET = ["checkpointing.enabled=false", "logging.progress_bar=false", "logging.tensorboard=false"]


def rlflow(*args: str, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [str(RLFLOW), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def turn(prompt: list[int], generated: list[int], **item) -> dict:
    return {
        "prompt_token_ids": prompt,
        "generation_token_ids": [str(t) for t in generated],  # Gym's vllm_model may send text
        "generation_log_probs": [-0.5] * len(generated),
        **item,
    }


def answer(output: list[dict], reward=1.0) -> dict:
    return {"response": {"output": output}, "reward": reward}


# --- trajectories ----------------------------------------------------------------------------


def test_a_multi_turn_answer_trains_the_model_tokens_only():
    call = {"type": "function_call", "name": "get_weather", "arguments": '{"city": "SF"}'}
    output = [
        turn([1, 2, 3], [10, 11], **call),
        {"type": "function_call_output", "output": '{"weather": "cold"}'},
        turn([1, 2, 3, 10, 11, 20, 21, 22], [12, 13, 14], type="message", role="assistant"),
    ]
    trajectory = convert(answer(output, reward=0.5), version=3)
    c = trajectory.completion
    assert trajectory.prompt_ids == [1, 2, 3] and trajectory.turns == 2
    assert c.token_ids == [10, 11, 20, 21, 22, 12, 13, 14]
    assert c.loss_mask == [1, 1, 0, 0, 0, 1, 1, 1]
    assert c.logprobs == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5, -0.5, -0.5]
    assert c.token_versions == [3] * 8 and trajectory.reward == 0.5
    assert trajectory.malformed == {}


def test_the_train_batch_masks_environment_tokens():
    from rlflow.model.media import Media, Prompt
    from rlflow.train.rollouts import build_train_batch

    output = [turn([1, 2], [5]), turn([1, 2, 5, 7, 8], [6])]
    c = convert(answer(output), version=0).completion
    prompt = Prompt("p", "", (1, 2), Media())
    batch = build_train_batch(
        [prompt], [c], [1.0], prompt_ids=lambda p: list(p.token_ids), pad_token_id=0
    )
    # targets are input_ids[1:]: 2 | 5 7 8 6 -> only 5 and 6 are trained
    assert batch.target_mask[0].tolist() == [False, True, False, False, True]


def test_a_re_rendered_turn_is_refused_naming_the_turn_and_position():
    output = [turn([1, 2, 3], [10, 11]), turn([1, 2, 3, 10, 99, 20], [12])]
    with pytest.raises(TaskFailed) as caught:
        convert(answer(output), version=0)
    assert caught.value.reason == "discontinuous_tokens"
    assert "turn 1" in caught.value.detail and "at token 4" in caught.value.detail


EMPTY = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ""}]}
SAID = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}
USER = {"type": "message", "role": "user", "content": "go on"}


def test_gyms_converter_leaves_an_empty_assistant_turn_out_of_the_next_request():
    """The premise of the rule below, on Gym's own converter (the `vllm_model` server's): a turn
    that generated only its end-of-turn token (no text, no tool call) is not in the next
    request's messages, its ids neither; the conversation goes on from the turn before it. The
    items Gym makes of the turns are the ones convert() reads."""
    from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
    from nemo_gym.responses_converter import ResponsesConverter

    gym = ResponsesConverter(return_token_id_information=True, uses_reasoning_parser=False)

    def said(text: str, prompt: list[int], generated: list[int]) -> list[dict]:
        message = {"role": "assistant", "content": text, "prompt_token_ids": prompt,
                   "generation_token_ids": generated, "generation_log_probs": [-0.5] * len(generated)}  # fmt: skip
        return [
            i.model_dump(exclude_none=True) for i in gym.postprocess_assistant_message_dict(message)
        ]

    user = {"role": "user", "content": "go on"}
    first, empty = said("hi", [1, 2, 3], [10, 11]), said("", [1, 2, 3, 10, 11, 20, 21], [0])
    items = [{"role": "user", "content": "count"}, *first, user, *empty, user]
    request = NeMoGymResponseCreateParamsNonStreaming.model_validate({"input": items})
    messages = gym.responses_to_chat_completion_create_params(request).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "user"]
    assert messages[1]["prompt_token_ids"] == [1, 2, 3]  # the last ids sent back: turn 0's
    output = [*first, user, *empty, user, *said("ok", [1, 2, 3, 10, 11, 20, 22, 23], [12])]
    trajectory = convert(answer(output), version=0)
    assert trajectory.left_out == 1 and trajectory.completion.token_ids == [10, 11, 20, 22, 23, 12]


def test_an_empty_turn_gym_left_out_is_not_trained_and_is_counted():
    """Turn 1 generated only its end-of-turn token (0); Gym went on without it, so turn 2's
    prompt continues turn 0: the episode is what the model saw (turn 1 not in it)."""
    output = [
        turn([1, 2, 3], [10, 11], **SAID), USER,
        turn([1, 2, 3, 10, 11, 20, 21], [0], **EMPTY), USER,
        turn([1, 2, 3, 10, 11, 20, 22, 23], [12], **SAID),
    ]  # fmt: skip
    trajectory = convert(answer(output), version=0)
    c = trajectory.completion
    assert trajectory.prompt_ids == [1, 2, 3] and trajectory.turns == 2 and trajectory.left_out == 1
    assert c.token_ids == [10, 11, 20, 22, 23, 12] and c.loss_mask == [1, 1, 0, 0, 0, 1]
    # an empty first turn: the episode starts from the prompt the second turn was given
    output = [turn([1, 2, 3], [0], **EMPTY), USER, turn([1, 2, 5, 6], [12], **SAID)]
    trajectory = convert(answer(output), version=0)
    assert trajectory.prompt_ids == [1, 2, 5, 6] and trajectory.completion.token_ids == [12]
    assert trajectory.turns == 1 and trajectory.left_out == 1


def test_only_an_empty_turn_may_be_left_out():
    """A turn that said something and is missing from the next prompt is a broken episode, and
    so is a prompt that continues neither the empty turn nor the conversation before it."""
    output = [turn([1, 2, 3], [10, 11], **SAID), turn([1, 2, 3, 10, 11, 20], [7], **SAID), USER,
              turn([1, 2, 3, 10, 11, 20, 30], [12], **SAID)]  # fmt: skip
    with pytest.raises(TaskFailed, match="turn 2's prompt differs .* at token 6"):
        convert(answer(output), version=0)
    output[1] = turn([1, 2, 3, 10, 11, 20], [0], **EMPTY)
    output[3] = turn([1, 2, 3, 10, 99], [12], **SAID)
    with pytest.raises(TaskFailed, match="turn 2's prompt differs .* at token 4"):
        convert(answer(output), version=0)


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"reward": 1.0}, "malformed_json"),
        (answer([turn([1], [2])], reward="high"), "malformed_json"),
        (answer([{"type": "message", "role": "assistant", "content": []}]), "no_token_ids"),
    ],
)
def test_an_answer_without_what_training_needs_fails_the_task(body, reason):
    with pytest.raises(TaskFailed) as caught:
        convert(body, version=0)
    assert caught.value.reason == reason


def test_malformed_tool_calls_are_counted_by_reason():
    output = [
        {"type": "function_call", "name": "get_weather", "arguments": "{city: SF"},
        {"type": "function_call_output", "output": '{"detail":"Not Found"}'},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "<tool_call>{oops</tool_call>"}],
        },
    ]
    assert malformed_tool_calls(output) == {
        "arguments_not_json": 1,
        "unknown_tool": 1,
        "unparsed_tool_call": 1,
    }


# --- real Gym servers ---------------------------------------------------------------------------


def multi_turn_tasks(path: Path) -> Path:
    """Gym's example_multi_turn_gymnasium rows (a question, then one or two scripted follow-ups:
    every episode has 2 or 3 model turns), with the verifier's expected answer made a letter the
    random model's last turn holds about half the time, so groups have rewards to learn from."""
    from rlflow.optional import gym_root

    data = gym_root() / "resources_servers" / "example_multi_turn_gymnasium" / "data"
    rows = [json.loads(line) for line in (data / "example.jsonl").read_text().splitlines()[:2]]
    for row in rows:
        row["expected_answer"] = "g"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gym_runs_train_on_the_single_tool_and_multi_turn_environments(tmp_path):
    """The multi-turn run: each later turn's prompt continues the earlier turns' ids (rlflow's
    server builds it from the ids Gym's vllm_model sends back), so no episode fails as
    `discontinuous_tokens`, and the trainer's logprobs of every model token, recomputed over
    the whole trajectory, are the server's."""
    runs = {
        "tool": [],
        "multi_turn": [
            f"environment.gym.config_paths=[{MULTI_TURN}]",
            "environment.gym.agent=example_multi_turn_gymnasium_agent",
            f"environment.gym.tasks={multi_turn_tasks(tmp_path / 'tasks.jsonl')}",
            "grpo.max_num_steps=1",
        ],
    }
    for name, overrides in runs.items():
        run_dir = tmp_path / name
        result = rlflow("train", str(GYM_TOOL), *QUIET, *overrides, "--run-dir", str(run_dir))
        assert result.returncode == 0, result.stderr[-3000:]
        records = read_metrics(run_dir)
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        for record in records:
            assert record["env/tasks"] == 8 and record["env/failed_tasks"] == 0, record
            assert record["env/turns_per_trajectory"] >= 1
            assert record["train/real_tokens"] > 0
            assert abs(record["train/token_mult_prob_error"] - 1.0) < 1e-3, record
            assert "time/environment" in record
        logs = sorted(p.name for p in (run_dir / "gym").iterdir())
        assert "policy_model.log" in logs and len(logs) == 3
        if name == "tool":  # Gym's verify rewards every finished episode of this one with 1
            assert records[-1]["train/reward"] == 1.0
        else:  # 2 or 3 model turns in every episode
            assert records[-1]["env/turns_per_trajectory"] >= 2


ONE_STEP_OFF = ["generation.placement=separate", "async_grpo.max_staleness=1"]


def train_one_step_off(run_dir: Path, generation_ranks: int, overrides: list[str]) -> list:
    """The Gym recipe one-step-off: one training rank and `generation_ranks` of their own, on
    this machine through the console script; its metrics."""
    shape = [f"generation.gpus_per_node={generation_ranks}", "--nproc", str(generation_ranks + 1)]
    result = rlflow(
        "train", str(GYM_TOOL), *QUIET, *ONE_STEP_OFF, *overrides, *shape, "--run-dir", str(run_dir)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


def test_gym_trains_one_step_off_on_a_tensor_parallel_engine_of_its_own(tmp_path):
    """Asynchronous GRPO with Gym (`generation.placement: separate`, one-step-off): ranks 1-2
    only generate, one engine split over both (generation.tensor_parallel_size 2: rank 1
    serves Gym's multi-turn environment and sends rank 2 its plans); rank 0 trains. Batch k is
    generated with the weights of step k - 2 (0 for the first two), every model turn of every
    trajectory is checked against that (`async/turn_staleness_max`), the weight sync (one
    trainer shard to two engine shards) moves the server to the new version, and the
    environment's metrics reach the trainer's log. (One server: with two, which server takes
    which turn varies, and so do the tiny model's tool calls, some of them malformed.)"""
    run_dir = tmp_path / "run"
    records = train_one_step_off(run_dir, 2, [
        f"environment.gym.config_paths=[{MULTI_TURN}]",
        "environment.gym.agent=example_multi_turn_gymnasium_agent",
        f"environment.gym.tasks={multi_turn_tasks(tmp_path / 'tasks.jsonl')}",
        "grpo.max_num_steps=3", "generation.tensor_parallel_size=2",
    ])  # fmt: skip
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["async/weight_version"] for r in records] == [0.0, 0.0, 1.0]
    assert [r["async/turn_staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    for record in records:
        assert record["env/tasks"] == 8 and record["env/failed_tasks"] == 0, record
        assert record["env/turns_per_trajectory"] >= 2 and record["async/stale_turns"] == 0
        assert record["env/policy_servers"] == 1  # the engine's first rank
    # step 1 trains the weights that generated it: the server's logprobs are the trainer's
    # (later steps train on one-step-old turns: the importance corrections' business)
    assert abs(records[0]["train/token_mult_prob_error"] - 1.0) < 1e-3, records[0]
    logs = sorted(p.name for p in (run_dir / "gym").iterdir())
    assert "policy_model.log" in logs and len(logs) == 3


CIRCLES = "resources_servers/circle_count/configs/circle_count.yaml"


def test_the_vlm_environment_circle_count_trains_the_tiny_vlm_on_its_images(tmp_path):
    """Gym's circle_count (an image per task, one answer) on the tiny Qwen2.5-VL, one-step-off
    on two generation ranks: both engines serve (vllm_model spreads the sessions over their
    servers), and each server keeps the prompts it made (with the pixels), which the leader
    gathers for the trainer's forward."""
    records = train_one_step_off(tmp_path / "run", 2, [
        "model.checkpoint=builtin:tiny-qwen25vl", f"environment.gym.config_paths=[{CIRCLES}]",
        "environment.gym.agent=circle_count_simple_agent", "grpo.max_num_steps=1",
        "grpo.num_prompts_per_step=2", "generation.server.context_tokens=4096",
    ])  # fmt: skip
    [record] = records
    assert record["env/tasks"] == 8 and record["env/failed_tasks"] == 0, record
    assert record["env/policy_servers"] == 2 and record["env/policy_server_turns_min"] > 0
    # each row's image pad tokens met its pixels: the trainer checks them against each other
    assert record["train/real_tokens"] > 0


def test_the_founding_workload_in_miniature_omni_in_circle_count_one_step_off(tmp_path):
    """The founding workload's parts together, tiny: Nemotron Omni (RADIO tower over a hybrid
    Mamba-2/attention language model) in Gym's VLM environment, one-step-off on a
    tensor-parallel engine of its own, as the founding recipe generates (TP 4 there, TP 2 here):
    rank 1 serves Gym's turns (images through the family's processor) and sends rank 2 its
    plans, while rank 0 trains at TP 1 on them, with the pixels of the prompts the server made.
    The weight sync cuts the trainer's whole Mamba weights into the engine's two shards part by
    part (in_proj's [z; x; B; C; dt]): the server's logprobs are the trainer's."""
    records = train_one_step_off(tmp_path / "run", 2, [
        "model.checkpoint=builtin:tiny-nemotron-omni", f"environment.gym.config_paths=[{CIRCLES}]",
        "environment.gym.agent=circle_count_simple_agent", "grpo.num_prompts_per_step=2",
        "generation.server.context_tokens=4096", "grpo.max_num_steps=2",
        "generation.tensor_parallel_size=2",
    ])  # fmt: skip
    assert [r["async/weight_version"] for r in records] == [0.0, 0.0]
    for record in records:
        assert record["env/tasks"] == 8 and record["env/failed_tasks"] == 0, record
        assert record["env/policy_servers"] == 1  # the engine's first rank
        assert record["train/real_tokens"] > 0  # each row's image tokens met their pixels
    assert abs(records[0]["train/token_mult_prob_error"] - 1.0) < 1e-3, records[0]


FLAKY = """
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig, BaseVerifyRequest, BaseVerifyResponse, SimpleResourcesServer,
)


class FlakyConfig(BaseResourcesServerConfig):
    pass


class Flaky(SimpleResourcesServer):
    config: FlakyConfig

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        if "please fail" in str(body.responses_create_params.input):
            raise RuntimeError("the verifier broke")
        return BaseVerifyResponse(**body.model_dump(), reward=float(len(str(body.response)) % 2))


if __name__ == "__main__":
    Flaky.run_webserver()
"""


def test_a_failing_task_is_counted_and_its_group_left_out(tmp_path):
    """A resources server whose verifier fails for one task: HTTP 500 through the agent,
    `env/failed_tasks/http_500` counts its 4 episodes, the other group trains."""
    config = _local_server(tmp_path, "flaky", FLAKY)
    rows = [
        {"responses_create_params": {"input": [{"role": "user", "content": text}]}}
        for text in ("hi", "please fail")
    ]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"environment.gym.config_paths=[{config}]", "environment.gym.agent=agent",
        "environment.gym.tasks=tasks.jsonl", "grpo.max_num_steps=1",
    ]  # fmt: skip
    run_dir = tmp_path / "run"
    result = rlflow("train", str(GYM_TOOL), *QUIET, *overrides, "--run-dir", str(run_dir),
                    cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    [record] = read_metrics(run_dir)
    assert record["env/failed_tasks"] == 4 and record["env/failed_tasks/http_500"] == 4
    assert record["env/tasks"] == 8 and record["train/real_tokens"] > 0  # the other group trained
    assert "warning[gym.tasks-failed]: step 1: 4 NeMo Gym tasks failed" in result.stderr
    assert "note: http_500 (4): " in result.stderr  # the first failure's answer, for the user


def _local_server(root: Path, name: str, app: str) -> str:
    """A Gym config of one resources server `name` whose app.py is `app` (under root)."""
    folder = root / "resources_servers" / name
    folder.mkdir(parents=True)
    (folder / "app.py").write_text(app)
    config = root / f"{name}.yaml"
    config.write_text(
        f"{name}:\n  resources_servers:\n    {name}:\n      entrypoint: app.py\n      domain: other\n"
        f"agent:\n  responses_api_agents:\n    simple_agent:\n      entrypoint: app.py\n"
        f"      resources_server: {{type: resources_servers, name: {name}}}\n"
        f"      model_server: {{type: responses_api_models, name: policy_model}}\n"
    )
    return str(config)


@pytest.mark.parametrize(
    "app, ready_s, code, words",
    [
        ("import time\ntime.sleep(600)\n", 2, "gym.not-ready", ["never_up", "2 s"]),
        ("raise SystemExit(3)\n", 120, "gym.server-died", ["never_up", "status 3"]),
    ],
    ids=["hangs", "exits"],
)
def test_a_gym_server_that_never_comes_up_ends_the_start_naming_it(
    tmp_path, monkeypatch, app, ready_s, code, words
):
    from rlflow.recipe.gym_schema import GymConfig
    from rlflow.train.gym.servers import GymServers, gym_config, servers_to_start

    monkeypatch.chdir(tmp_path)
    cfg = GymConfig(
        config_paths=[_local_server(tmp_path, "never_up", app)], agent="agent",
        resource_servers=["never_up"], tasks="x.jsonl", concurrency=1,
        ready_timeout_s=ready_s, head_port=_free_port(),
    )  # fmt: skip
    config = gym_config(cfg, ["http://127.0.0.1:9"], "policy")
    servers = GymServers(config, servers_to_start(config, cfg), tmp_path / "logs", ready_s)
    with pytest.raises(RlflowError) as caught:
        servers.start()
    [diagnostic] = caught.value.diagnostics
    text = diagnostic.render()
    assert diagnostic.code == code and all(w in text for w in words), text
    assert servers.processes == {} and servers.head is None  # everything it started is gone


def test_a_gym_server_that_never_comes_up_on_the_generation_rank_ends_the_job(tmp_path):
    """Asynchronous GRPO with Gym: the generation rank starts Gym's servers; one that never
    answers ends the whole job (the trainer waiting for its first batch too) soon after
    environment.gym.ready_timeout_s, naming the server, and leaves no server process behind."""
    config = _local_server(tmp_path, "never_up", "import time\ntime.sleep(600)\n")
    tasks = tmp_path / "tasks.jsonl"
    row = {"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}}
    tasks.write_text(json.dumps(row) + "\n")
    overrides = [
        f"environment.gym.config_paths=[{config}]", "environment.gym.agent=agent",
        "environment.gym.resource_servers=[never_up]", f"environment.gym.tasks={tasks}",
        "environment.gym.ready_timeout_s=3", *ONE_STEP_OFF, "generation.gpus_per_node=1",
    ]  # fmt: skip
    run_dir = tmp_path / "run"
    result = rlflow(
        "train", str(GYM_TOOL), *QUIET, *overrides, "--nproc", "2", "--run-dir", str(run_dir),
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    generation_log = (run_dir / "logs" / "rank-1.log").read_text()
    assert "error[gym.not-ready]" in generation_log and "never_up" in generation_log
    assert "Traceback" not in generation_log
    server_dir = str(tmp_path / "resources_servers" / "never_up")
    assert not [p for p in Path("/proc").glob("[0-9]*") if _cwd(p) == server_dir]


def _cwd(process: Path) -> str | None:
    try:
        return os.readlink(process / "cwd")
    except OSError:
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_tasks_setting_names_a_file_or_an_agent_dataset(tmp_path):
    from rlflow.train.gym.tasks import load_tasks

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input": "no responses_create_params"}) + "\n")
    with pytest.raises(RlflowError) as caught:
        load_tasks(bad)
    assert "bad.jsonl:1" in caught.value.diagnostics[0].render()
