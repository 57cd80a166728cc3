"""Why a weight refresh resets both of vLLM's caches: each test leaves one reset out and shows the harm.

The worker is asked directly (`worker.call`) for a reload with one reset missing; the backend's
own `refresh_weights` always sends both.
"""

from __future__ import annotations

import pytest

from rlflow.errors import RlflowError
from tests.tiny import greedy, make_prompt


def reload(backend, state, resets, folder):
    from rlflow.generation.vllm.client import write_weights

    path = write_weights(state, folder)
    # the version the backend holds: only the caches differ from its own refresh_weights
    message = {
        "op": "reload",
        "path": str(path),
        "resets": resets,
        "version": backend.weight_version,
    }
    backend.worker.call(message, timeout_s=600)


def changed_weights(policy) -> dict:
    """The policy's weights with one early layer scaled: every later key and value changes."""
    from rlflow.model.build import export_hf_state_dict

    state = export_hf_state_dict(policy)
    name = "model.layers.0.mlp.down_proj.weight"
    return {**state, name: state[name] * 3.0}


def test_without_the_prefix_cache_reset_a_long_prompt_silently_uses_stale_weights(
    start_vllm, tiny_policy, tiny_processor, tmp_path
):
    eos = tiny_processor.tokenizer.eos_token_id
    short = make_prompt(tiny_processor, "text", "How many cubes?", seed=1)
    long = make_prompt(
        tiny_processor, "text", " ".join(["how many red cubes are in the picture"] * 30), seed=2
    )
    assert len(long.token_ids) >= 2 * 128  # whole KV blocks (128 tokens on CPU) get prefix-cached
    backend = start_vllm(tiny_policy)
    params = greedy(12, eos)
    backend.generate([short, long], params)  # caches the long prompt's blocks under the old weights
    reload(backend, changed_weights(tiny_policy), resets=["encoder"], folder=tmp_path)
    stale = backend.generate([short, long], params)
    reload(backend, changed_weights(tiny_policy), resets=["encoder", "prefix"], folder=tmp_path)
    fresh = backend.generate([short, long], params)
    assert (
        stale[0].token_ids == fresh[0].token_ids
    )  # short prompt: recomputed, new weights either way
    assert stale[1].token_ids != fresh[1].token_ids  # long prompt: old keys and values were reused


def test_without_the_encoder_cache_reset_the_next_image_prompt_kills_the_engine(
    start_vllm, tiny_policy, tiny_processor, tmp_path
):
    from rlflow.model.build import export_hf_state_dict

    eos = tiny_processor.tokenizer.eos_token_id
    image = make_prompt(tiny_processor, "image", "How many red squares are there?", seed=1)
    backend = start_vllm(tiny_policy)
    state = export_hf_state_dict(tiny_policy)
    backend.generate([image], greedy(4, eos))
    reload(backend, state, resets=["encoder", "prefix"], folder=tmp_path)
    backend.generate([image], greedy(4, eos))  # both resets: the same image works again
    reload(backend, state, resets=["prefix"], folder=tmp_path)
    with pytest.raises(RlflowError, match="Encoder cache miss"):
        backend.generate([image], greedy(4, eos))
    assert not backend.worker.alive()  # a failed worker is stopped, never reused
