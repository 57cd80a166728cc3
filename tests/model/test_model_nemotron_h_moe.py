"""Nemotron-H with MoE layers (`builtin:tiny-nemotron-h-moe`, pattern `ME*E-`: 8 squared-ReLU
experts top-2 in 2 groups, a shared expert, sigmoid router with a correction bias, scaling 2.5)
through megatron-bridge into megatron-core's hybrid stack with rlflow's MoE layer and grouped
experts, equal to HF transformers in fp32: logits, padded and packed token logprobs, the HF round
trip (on disk per expert, in HF's memory stacked), and router replay: the trainer agrees with
HF's expert choices, and routed to other experts it computes what HF computes routed to them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.tiny import (
    FP32,
    SINGLE,
    logprobs_against_hf,
    packed_logprobs,
    policy_and_hf,
    right_padded,
)

MOE_LAYERS = (1, 3)  # the `E`s of `ME*E-`


@pytest.fixture(scope="module")
def moe_hybrid(single_rank, family_ckpt):
    from transformers import NemotronHForCausalLM

    policy, tokenizer, hf, rows = policy_and_hf(
        family_ckpt("tiny-nemotron-h-moe"), NemotronHForCausalLM
    )
    ids, mask = right_padded(rows, tokenizer.pad_token_id)
    return policy, hf, ids, mask


def _packed_logprobs(policy, ids, mask):
    return packed_logprobs(policy, ids, mask, mask[:, 1:] & mask[:, :-1])


def _hf_logprobs(hf, ids, mask):
    logits = hf(input_ids=ids, attention_mask=mask.long()).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    return logits, lp[mask[:, 1:] & mask[:, :-1]]


def test_moe_layers_are_megatron_cores_with_grouped_squared_relu_experts(moe_hybrid):
    from rlflow.model.moe.experts import relu2_experts

    policy = moe_hybrid[0]
    layers = policy.core.decoder.layers
    kinds = [type(layer).__name__ for layer in layers]
    assert kinds == ["MambaLayer", "MoETransformerLayer", "TransformerLayer"] + kinds[1:2] + [
        "MLPLayer"
    ]
    moe = layers[1].mlp
    assert type(moe.experts).__name__ == "GroupedExperts" and moe.experts._grouped is relu2_experts
    assert moe.shared_experts is not None and moe.router.score_function == "sigmoid"
    assert moe.router.expert_bias.abs().sum() > 0  # the checkpoint's correction bias, loaded


def test_padded_and_packed_logprobs_match_hf(moe_hybrid):
    policy, hf, ids, mask = moe_hybrid
    packed_lp, ref_lp, padded_lp = logprobs_against_hf(policy, hf, ids, mask)
    assert float(torch.exp((packed_lp - ref_lp).abs().mean())) < 1.0 + 1e-5
    assert (packed_lp - ref_lp).abs().max() < 1e-4
    assert (packed_lp - padded_lp).abs().max() < 1e-5


def test_hf_round_trip_is_exact(moe_hybrid):
    from safetensors.torch import load_file

    from rlflow.model.build import export_hf_state_dict

    policy, hf = moe_hybrid[:2]
    exported = export_hf_state_dict(policy)
    on_disk = load_file(str(policy.checkpoint / "model.safetensors"))
    assert sorted(exported) == sorted(on_disk)
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)
    state = hf.state_dict()  # in memory: `model.*`, each layer's experts stacked
    in_memory = policy.family.hf_state_dict(exported)
    assert sorted(in_memory) == sorted(state)
    assert all(torch.equal(in_memory[k], state[k]) for k in state)


def _hf_routes(hf, ids, mask, forced=None):
    """HF's forward, recording each MoE layer's chosen experts [rows, L, layers, k] (-1 at
    padding and in non-MoE layers); with `forced` ([rows, L, layers, k]) HF's routers take
    those experts instead, weighted as HF weights its own choice (sigmoid scores at the chosen
    experts, renormalised, scaled)."""
    rows, length = ids.shape
    routes = torch.full((rows, length, len(hf.model.layers), 2), -1)
    originals = {}
    for index in MOE_LAYERS:
        gate = hf.model.layers[index].mixer.gate
        originals[index] = gate.forward

        def forward(hidden, gate=gate, index=index, original=gate.forward):
            logits, weights, chosen = original(hidden)
            if forced is not None:
                chosen = forced[:, :, index].reshape(-1, 2)
                weights = logits.sigmoid().gather(1, chosen)
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
                weights = weights * gate.routed_scaling_factor
            routes[:, :, index] = chosen.view(rows, length, 2)
            return logits, weights, chosen

        gate.forward = forward
    try:
        _, lp = _hf_logprobs(hf, ids, mask)
    finally:
        for index, forward in originals.items():
            hf.model.layers[index].mixer.gate.forward = forward
    routes[~mask] = -1
    return routes, lp


def test_router_replay_follows_hfs_routes(moe_hybrid):
    """The trainer's own expert choices equal HF's (agreement 1, replayed or not), and replaying
    other experts (a permutation in every other position) gives the logprobs HF computes when
    its routers are forced to the same experts."""
    from rlflow.model.moe import routing

    policy, hf, ids, mask = moe_hybrid
    with torch.no_grad():
        routes, hf_lp = _hf_routes(hf, ids, mask)
        assert set(routes[..., MOE_LAYERS, :].unique().tolist()) == {-1, *range(8)}
        changed = routes.clone()
        changed[:, 1::2] = torch.where(routes[:, 1::2] >= 0, (routes[:, 1::2] + 3) % 8, -1)
        forced_routes, forced_lp = _hf_routes(hf, ids, mask, forced=changed.clamp(min=0))
        assert torch.equal(forced_routes[mask], changed[mask])
        results = {}
        for name, recorded, replay in [
            ("own", routes, True),
            ("compared", changed, False),
            ("forced", changed, True),
        ]:
            batch = SimpleNamespace(routing=recorded, attention_mask=mask)
            with routing.replayed(policy, batch, packed=True, replay=replay):
                results[name] = _packed_logprobs(policy, ids, mask)
            results[name + "/metrics"] = routing.step_metrics(policy)
    assert results["own/metrics"]["moe/routing_agreement"] == 1.0
    assert (results["own"] - hf_lp).abs().max() < 1e-4
    known = (changed[..., MOE_LAYERS, 0] >= 0)[mask]
    same = (changed == routes).all(-1)[..., MOE_LAYERS][mask]
    expected = same.sum().item() / known.sum().item()
    assert abs(results["compared/metrics"]["moe/routing_agreement"] - expected) < 1e-9
    assert (results["compared"] - hf_lp).abs().max() < 1e-4
    assert (forced_lp - hf_lp).abs().max() > 1e-2  # the other experts matter ...
    assert (results["forced"] - forced_lp).abs().max() < 1e-4  # ... and are HF's


def test_the_30b_a3b_preset_converts_to_the_published_moe_provider(single_rank, tmp_path):
    """The `nemotron-h-30b-a3b` preset's config.json (no weights) through the bridge and the
    family: the provider megatron-bridge's recipe for Nemotron-3 Nano 30B-A3B writes by hand."""
    from megatron.bridge import AutoBridge

    from rlflow.model.build import _configure_provider
    from rlflow.model.families.nemotron_h import FAMILY, PRESETS, hf_config

    config = hf_config(PRESETS["nemotron-h-30b-a3b"])
    config.architectures = ["NemotronHForCausalLM"]
    config.save_pretrained(tmp_path)
    FAMILY.register_bridge()
    bridge = AutoBridge.from_hf_pretrained(str(tmp_path))
    provider = bridge.to_megatron_provider(load_weights=False)
    _configure_provider(provider, SINGLE, torch.bfloat16)
    FAMILY.configure_provider(provider, bridge.hf_pretrained.config, FP32)
    provider.finalize()
    want = dict(
        num_layers=52, hybrid_layer_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        hidden_size=2688, num_attention_heads=32, num_query_groups=2, kv_channels=128,
        mamba_num_heads=64, mamba_head_dim=64, mamba_num_groups=8, mamba_state_dim=128,
        num_moe_experts=128, moe_router_topk=6, moe_ffn_hidden_size=1856,
        moe_shared_expert_intermediate_size=3712, moe_router_topk_scaling_factor=2.5,
        moe_router_num_groups=1, moe_router_group_topk=1, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_dtype="fp32", vocab_size=131072,
    )  # fmt: skip
    assert {key: getattr(provider, key) for key in want} == want


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"moe_latent_size": 32}, "moe_latent_size 32"),
        ({"norm_topk_prob": False}, "norm_topk_prob false"),
        ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 6}, "topk_group 2 != 2"),
    ],
)
def test_moe_settings_megatron_would_compute_otherwise_are_refused(changes, named):
    from rlflow.errors import RlflowError
    from rlflow.model.families.nemotron_h import PRESETS, hf_config
    from rlflow.model.families.nemotron_h.model import check_config

    config = hf_config(PRESETS["tiny-nemotron-h-moe"])
    check_config(config)  # the builtin's own settings pass
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises(RlflowError) as raised:
        check_config(config)
    (diagnostic,) = raised.value.diagnostics
    assert diagnostic.code == "model.nemotron-h-unsupported" and named in diagnostic.message
