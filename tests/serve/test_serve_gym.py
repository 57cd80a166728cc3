"""NeMo Gym's `vllm_model` server (nemo-gym from PyPI, the `gym` extra) pointed at rlflow's server:
the class RL environments use to reach a policy, run as it is, over real HTTP."""

from __future__ import annotations

import httpx
import pytest

from rlflow.generation.base import SamplingParams
from tests.serve.conftest import MODEL, wait_until
from tests.tiny import make_prompt, megatron_generation


@pytest.fixture(scope="module")
def gym_model(server):
    """VLLMModel as a Gym config names it (its base_url our server), served by uvicorn on its
    own port as Gym runs it. It would reach the Gym head server only to start runs: it gets a
    real ServerClient with an empty global config, and Gym's global aiohttp client (which Gym
    makes when its servers start) is made on the model server's loop at startup."""
    import asyncio
    import contextlib
    import socket
    import threading

    import uvicorn
    from nemo_gym import server_utils
    from nemo_gym.server_utils import BaseServerConfig, ServerClient
    from omegaconf import OmegaConf
    from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

    config = VLLMModelConfig(
        host="127.0.0.1", port=0, entrypoint="", name="policy_model",
        base_url=f"{server.url}/v1", api_key="unused", model=MODEL,
        return_token_id_information=True, uses_reasoning_parser=False,
    )  # fmt: skip
    head = BaseServerConfig(host="127.0.0.1", port=0)
    client = ServerClient(head_server_config=head, global_config_dict=OmegaConf.create({}))
    app = VLLMModel(config=config, server_client=client).setup_webserver()
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app):
        session = server_utils.set_global_aiohttp_client(
            server_utils.GlobalAIOHTTPAsyncClientConfig()
        )
        async with inner(app) as state:
            yield state
        await session.close()
        server_utils._GLOBAL_AIOHTTP_CLIENT = None

    app.router.lifespan_context = lifespan
    sock = socket.create_server(("127.0.0.1", 0))
    gym = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(gym.serve(sockets=[sock])))
    thread.start()
    wait_until(lambda: gym.started, "the Gym model server to start")
    with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=120) as http:
        yield http
    gym.should_exit = True
    thread.join()


def test_gym_chat_completions_carry_the_engines_token_ids(gym_model, tiny_policy, tiny_processor):
    question = "How many red squares are there?"
    response = gym_model.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": question}], "max_tokens": 8, "seed": 9},
    )
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    prompt = make_prompt(tiny_processor, "text", question)
    eos = tiny_processor.tokenizer.eos_token_id
    [expected] = megatron_generation(tiny_policy, 0).generate(
        [prompt], SamplingParams(8, 1.0, 1.0, 0, 9, (eos,), False)
    )
    assert message["prompt_token_ids"] == list(prompt.token_ids)
    assert [int(t) for t in message["generation_token_ids"]] == expected.token_ids
    gap = max(abs(a - b) for a, b in zip(message["generation_log_probs"], expected.logprobs))
    assert gap < 1e-4


def test_gym_responses_api_round_trip(gym_model):
    """The Responses API an agent speaks, converted by Gym into a chat completion on our server
    and back: the output message carries the token information training needs, and an agent's
    second turn (the first turn's output sent back as input, as Gym's agents do) gets a prompt
    that continues the first turn's prompt and generated ids."""
    question = [{"role": "user", "content": "Count the cubes."}]
    response = gym_model.post("/v1/responses", json={"input": question, "max_output_tokens": 6})
    assert response.status_code == 200, response.text
    [output] = response.json()["output"]
    assert output["type"] == "message"
    assert len(output["generation_token_ids"]) == len(output["generation_log_probs"]) >= 1
    assert output["prompt_token_ids"]
    then = [*question, output, {"role": "user", "content": "And the spheres?"}]
    response = gym_model.post("/v1/responses", json={"input": then, "max_output_tokens": 4})
    assert response.status_code == 200, response.text
    [second] = response.json()["output"]
    first = output["prompt_token_ids"] + [int(t) for t in output["generation_token_ids"]]
    assert second["prompt_token_ids"][: len(first)] == first
