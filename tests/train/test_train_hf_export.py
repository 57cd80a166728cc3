"""checkpointing.hf_export_period: the policy as an HF checkpoint that transformers loads and
generates from, for every family; written by rank 0 alone, atomically, gathered under tensor
parallelism."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from rlflow.model import family
from tests.tiny import FP32, SINGLE, base_recipe, make_prompt

FAMILIES = family.builtin_names()


def _prompts(processor, multimodal: bool):
    kinds = ["image", "text", "video"] if multimodal else ["text"]
    return [make_prompt(processor, k, "How many red squares are there?", seed=i) for i, k in
            enumerate(kinds)]  # fmt: skip


@pytest.mark.parametrize("name", FAMILIES)
def test_an_export_loads_in_transformers_with_the_policys_weights_and_generates(
    single_rank, family_ckpt, tmp_path, name
):
    from transformers import AutoProcessor

    from rlflow.model.build import load_policy
    from rlflow.model.forward import policy_logits
    from rlflow.train import hf_export

    policy = load_policy(family_ckpt(name), FP32, SINGLE, trainable=False)
    torch.manual_seed(0)  # the same weights whatever ran before in this process
    with torch.no_grad():  # weights that are not the checkpoint's: the export must carry them
        for param in policy.core.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    out = hf_export.export_step(policy, tmp_path, step=3, keep_last=1)
    assert out == tmp_path / "hf" / "step_000003" and not list((tmp_path / "hf").glob("*.tmp"))
    hf, info = policy.family.hf_class().from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True
    )
    hf.eval()  # every tensor came from the export: none missing (HF would draw it), none unused
    assert not any(info.values()), (name, info)
    processor = AutoProcessor.from_pretrained(str(out))
    for prompt in _prompts(processor, policy.family.multimodal):
        ids = torch.tensor([policy.prompt_ids(prompt)])
        media = {k: v for k, v in vars(prompt.media).items() if v is not None}
        extra = policy.family.hf_generate_inputs(ids, policy.media_tokens)
        with torch.no_grad():
            new = hf.generate(input_ids=ids, **extra, **media, max_new_tokens=4, min_new_tokens=4,
                              do_sample=False)  # fmt: skip
            extra = policy.family.hf_generate_inputs(new, policy.media_tokens)
            ref = hf(input_ids=new, **extra, **media).logits
            ours = policy_logits(policy.core, new, torch.ones_like(new, dtype=torch.bool),
                                 prompt.media)  # fmt: skip
        assert new.shape[1] == ids.shape[1] + 4
        # the prompt and HF's 4 greedy tokens: the Megatron model's logits, and its greedy choices
        assert float((ours - ref).abs().max()) < 1e-4, (name, prompt.sample_id)
        greedy = ours[0, ids.shape[1] - 1 : -1].argmax(-1)
        assert torch.equal(new[0, ids.shape[1] :], greedy), (name, prompt.sample_id)


def test_exports_are_kept_as_asked_and_a_torn_one_is_replaced(single_rank, family_ckpt, tmp_path):
    from rlflow.model.build import load_policy
    from rlflow.train import hf_export

    policy = load_policy(family_ckpt("tiny-qwen3"), FP32, SINGLE, trainable=False)
    torn = tmp_path / "hf" / "step_000004.tmp"
    torn.mkdir(parents=True)
    (torn / "model.safetensors").write_bytes(b"half")
    for step in (2, 4, 6):
        hf_export.export_step(policy, tmp_path, step=step, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step_000004", "step_000006"]
    assert [hf_export.due(s, s == 7, 3) for s in range(1, 8)] == [0, 0, 1, 0, 0, 1, 1]
    assert not any(hf_export.due(s, True, 0) for s in range(1, 4))


def test_large_models_are_written_in_shards_with_an_index(single_rank, family_ckpt, tmp_path,
                                                           monkeypatch):  # fmt: skip
    from transformers import AutoModelForCausalLM

    from rlflow.model.build import load_policy
    from rlflow.train import hf_export

    policy = load_policy(family_ckpt("tiny-qwen3"), FP32, SINGLE, trainable=False)
    monkeypatch.setattr(hf_export, "SHARD_BYTES", 2**20)  # 1 MiB: the tiny model needs several
    out = hf_export.export_step(policy, tmp_path, step=1, keep_last=1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
    AutoModelForCausalLM.from_pretrained(str(out))  # transformers follows the index


def _tensor_parallel_worker(rank: int, port: int, root: str, name: str) -> None:
    import os
    from pathlib import Path

    from rlflow import parallel
    from rlflow.compat import library_logs
    from rlflow.model.build import load_policy
    from rlflow.recipe.schema import ParallelismConfig
    from rlflow.train import hf_export

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    library_logs.quiet()
    layout = ParallelismConfig(2, 1, 1, 1, "off")
    timeout_s = base_recipe().watchdog.collective_timeout_s
    parallel.init_parallel(layout, seed=1, timeout_s=timeout_s, placement=None)
    policy = load_policy(Path(root) / "model", FP32, layout, trainable=False)
    hf_export.export_step(policy, Path(root) / "run", step=1, keep_last=1)
    shard = policy.core.language_model.decoder.layers[0].self_attention.linear_qkv.weight
    result = {"qkv_rows": shard.shape[0], "logits_gap": _tp_logits_gap(policy, Path(root), rank)}
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(result))


def _tp_logits_gap(policy, root, rank: int) -> float:
    """The TP policy's forward (vocab shards gathered) against HF on a mixed batch (rank 0
    runs HF; the other rank reports 0)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoProcessor

    from rlflow.model.forward import policy_logits
    from rlflow.model.media import Media
    from tests.tiny import left_padded, mixed_prompts

    processor = AutoProcessor.from_pretrained(str(root / "model"))
    prompts = mixed_prompts(processor)
    ids, mask = left_padded(prompts, processor.tokenizer.pad_token_id)
    media = Media.concat([p.media for p in prompts])
    with torch.no_grad():
        ours = gather_from_tensor_model_parallel_region(
            policy_logits(policy.core, ids, mask.bool(), media)
        )
        if rank != 0:
            return 0.0
        hf = policy.family.hf_class().from_pretrained(str(root / "model"), dtype=torch.float32)
        ref = hf.eval()(
            input_ids=ids,
            attention_mask=mask,
            **policy.family.hf_generate_inputs(ids, policy.media_tokens),
            **{k: v for k, v in vars(media).items() if v is not None},
        ).logits
    return float((ours - ref).abs()[mask.bool()].max())


@pytest.mark.parametrize("name", ["tiny-qwen3vl-moe"])
def test_under_tensor_parallelism_rank_0_writes_the_gathered_weights(family_ckpt, tmp_path, name):
    """Two gloo ranks, TP 2 (experts split too): the export equals the checkpoint bit for bit,
    and the TP model's logits (vocab shards gathered) are HF's on a mixed media batch."""
    import shutil

    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    shutil.copytree(family_ckpt(name), tmp_path / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tensor_parallel_worker, args=(port, str(tmp_path), name), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["logits_gap"] < 1e-4, results  # the TP model is HF's too
    shards = [r["qkv_rows"] for r in results]
    source = load_file(str(tmp_path / "model" / "model.safetensors"))
    exported = load_file(str(tmp_path / "run" / "hf" / "step_000001" / "model.safetensors"))
    rows = sum(
        source[f"model.language_model.layers.0.self_attn.{x}_proj.weight"].shape[0] for x in "qkv"
    )
    assert shards[0] == shards[1] == rows // 2  # each rank held half of the attention
    assert set(exported) == set(source)
    for key, tensor in source.items():
        assert torch.equal(exported[key], tensor), key
