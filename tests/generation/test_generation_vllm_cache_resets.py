"""Why a weight refresh resets both of vLLM's caches: each test leaves one reset out and shows the harm.

The worker is asked directly (`worker.call`) for a reload with one reset missing; the backend's
own `refresh_weights` always sends both. Both harms are shown on one worker, the prefix cache's
first (the encoder cache's ends the worker).
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


def stale_prefix_cache(backend, policy, processor, folder):
    """Without the prefix cache reset, a long prompt silently uses stale weights."""
    eos = processor.tokenizer.eos_token_id
    short = make_prompt(processor, "text", "How many cubes?", seed=1)
    long = make_prompt(
        processor, "text", " ".join(["how many red cubes are in the picture"] * 30), seed=2
    )
    assert len(long.token_ids) >= 2 * 128  # whole KV blocks (128 tokens on CPU) get prefix-cached
    params = greedy(12, eos)
    backend.generate([short, long], params)  # caches the long prompt's blocks under the old weights
    reload(backend, changed_weights(policy), resets=["encoder"], folder=folder)
    stale = backend.generate([short, long], params)
    reload(backend, changed_weights(policy), resets=["encoder", "prefix"], folder=folder)
    fresh = backend.generate([short, long], params)
    assert (
        stale[0].token_ids == fresh[0].token_ids
    )  # short prompt: recomputed, new weights either way
    assert stale[1].token_ids != fresh[1].token_ids  # long prompt: old keys and values were reused


def stale_encoder_cache_kills_the_engine(backend, policy, processor, folder):
    """Without the encoder cache reset, the next image prompt kills the engine."""
    from rlflow.model.build import export_hf_state_dict

    eos = processor.tokenizer.eos_token_id
    image = make_prompt(processor, "image", "How many red squares are there?", seed=1)
    state = export_hf_state_dict(policy)
    backend.generate([image], greedy(4, eos))
    reload(backend, state, resets=["encoder", "prefix"], folder=folder)
    backend.generate([image], greedy(4, eos))  # both resets: the same image works again
    reload(backend, state, resets=["prefix"], folder=folder)
    with pytest.raises(RlflowError, match="Encoder cache miss"):
        backend.generate([image], greedy(4, eos))
    assert not backend.worker.alive()  # a failed worker is stopped, never reused


def test_each_cache_reset_left_out_does_its_own_harm(
    start_vllm, tiny_policy, tiny_processor, tmp_path
):
    """Both harms on one worker (a vLLM start is the expensive part): first the prefix cache's
    (every reload there resets the encoder cache, so the second part starts clean), then the
    encoder cache's, which ends the worker."""
    backend = start_vllm(tiny_policy)
    stale_prefix_cache(backend, tiny_policy, tiny_processor, tmp_path)
    stale_encoder_cache_kills_the_engine(backend, tiny_policy, tiny_processor, tmp_path)
