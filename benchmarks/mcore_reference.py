"""megatron-core 0.19.2's own inference engines on rlflow's policy, as the reference (issue 20).

`run(policy, prompts, params, ...)` tries, in order, on the language model of the policy the
benchmark already loaded (the same weights, the prompts' token ids):

1. `DynamicInferenceEngine` (megatron-core's continuous-batching engine, the one NeMo-RL's
   Megatron generation uses), with a `DynamicInferenceContext`, `GPTInferenceWrapper` and
   `TextGenerationController`;
2. if that cannot run, the static engine (`StaticInferenceEngine`).

Each attempt records what the environment has (Transformer Engine, flash-attn 2/3/4, FlashInfer
as megatron-core's attention module sees them) and either the tokens/s of a timed `generate`
or exactly what failed: the exception, its message, and the innermost megatron-core frame
(file, line, source). Neither engine can place vision features at a prompt's image tokens, so
the rows are text-only views of the batch: the same token ids (pad tokens for the images), the
same lengths, the language model's cost without the vision tower.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import time
import traceback


def environment() -> dict:
    """What megatron-core's attention module found at import: the engines' kernel options."""
    from megatron.core.transformer import attention

    found = {name: bool(getattr(attention, name, False)) for name in ("HAVE_FA3", "HAVE_FA4")}
    for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
        found[name] = getattr(attention, name, None) is not None
    for module in ("transformer_engine", "flash_attn", "flashinfer"):
        try:
            __import__(module)
            found[module] = True
        except Exception as err:  # ImportError, or a broken install
            found[module] = f"{type(err).__name__}: {err}"
    return found


def failure(err: BaseException) -> dict:
    """The exception and the innermost frame inside megatron-core that raised or called it."""
    frames = traceback.extract_tb(err.__traceback__)
    inner = [f for f in frames if "megatron" in f.filename] or frames
    where = inner[-1] if inner else None
    out = {"error": f"{type(err).__name__}: {err}"[:2000]}
    if where is not None:
        path = where.filename.split("site-packages/")[-1]
        out["where"] = f"{path}:{where.lineno} in {where.name}"
        out["source"] = (linecache.getline(where.filename, where.lineno) or "").strip()
    out["traceback_tail"] = traceback.format_exception(err)[-6:]
    return out


def run(policy, prompts, params, device, log, max_rows: int = 64) -> dict:
    """Both engines on the first `max_rows` rows (text-only views, see the module docstring)."""
    import torch

    rows = prompts[:max_rows]
    ids = [list(policy.prompt_ids(p)) for p in rows]
    out = {"environment": environment(), "rows": len(ids)}
    from megatron.core.inference.utils import InferenceMode

    for name, attempt in (("dynamic", _dynamic), ("static", _static)):
        start = time.perf_counter()
        try:
            with _plain_rope(_language_model(policy)):
                tokens = attempt(policy, ids, params, device)
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            seconds = time.perf_counter() - start
            out[name] = {"ran": True, "seconds": seconds, "tokens": tokens,
                         "tokens_per_s": tokens / seconds}  # fmt: skip
        except BaseException as err:  # noqa: BLE001 - the reference's failure is the result
            if isinstance(err, KeyboardInterrupt):
                raise
            out[name] = {"ran": False, **failure(err)}
        finally:
            # both engines set megatron-core's process-wide inference flag at construction and
            # never clear it; left on, the trainer's next forward asserts
            InferenceMode.unset_active()
            _language_model(policy).train()
        log(f"megatron-core {name} engine: {_short(out[name])}")
    return out


@contextlib.contextmanager
def _plain_rope(lm):
    """Qwen2/2.5-VL's language model uses multimodal rope (positions [3, batch, seq]), which
    megatron-core's inference wrappers do not build (they pass [batch, seq]). On the text-only
    rows this reference runs, the three position streams are equal, and mrope with equal streams
    is exactly 1-D rope with the same inverse frequencies: swap that in for the reference's
    calls, then put the model back."""
    if getattr(lm, "position_embedding_type", None) != "mrope":
        yield
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    mrope = lm.rotary_pos_emb
    plain = RotaryEmbedding(
        kv_channels=lm.config.kv_channels,
        rotary_percent=1.0,
        rotary_interleaved=lm.config.rotary_interleaved,
        rotary_base=10000,  # replaced by the model's own inverse frequencies just below
        use_cpu_initialization=lm.config.use_cpu_initialization,
    )
    plain.inv_freq = mrope.inv_freq
    lm.position_embedding_type, lm.rotary_pos_emb = "rope", plain
    try:
        yield
    finally:
        lm.position_embedding_type, lm.rotary_pos_emb = "mrope", mrope


def _short(result: dict) -> str:
    if result.get("ran"):
        return f"{result['tokens_per_s']:,.0f} tok/s ({result['tokens']} tokens)"
    return f"cannot run: {result['error'][:300]} at {result.get('where')}"


def _language_model(policy):
    from rlflow.model.forward import language_model

    return language_model(policy.core)


def _dynamic(policy, ids, params, device) -> int:
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    lm = _language_model(policy)
    lm.eval()
    longest = max(len(i) for i in ids) + params.max_new_tokens
    config = InferenceConfig(
        max_sequence_length=longest,
        buffer_size_gb=8,
        max_requests=len(ids),
        num_cuda_graphs=None,
        materialize_only_last_token_logits=True,
    )
    context = DynamicInferenceContext(model_config=lm.config, inference_config=config)
    wrapper = GPTInferenceWrapper(lm, context)
    controller = TextGenerationController(wrapper, tokenizer=_Tokenizer(policy))
    engine = DynamicInferenceEngine(controller, context)
    sampling = SamplingParams(
        temperature=1.0, top_k=0, top_p=0.0, num_tokens_to_generate=params.max_new_tokens,
        termination_id=-1, return_log_probs=True, skip_prompt_log_probs=True,
    )  # fmt: skip
    records = engine.generate([list(i) for i in ids], sampling)
    return sum(_generated(r) for r in records)


def _static(policy, ids, params, device) -> int:
    import torch
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines.static_engine import StaticInferenceEngine
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    lm = _language_model(policy)
    lm.eval()
    longest = max(len(i) for i in ids) + params.max_new_tokens
    context = StaticInferenceContext(len(ids), longest)
    wrapper = GPTInferenceWrapper(lm, context)
    controller = TextGenerationController(wrapper, tokenizer=_Tokenizer(policy))
    engine = StaticInferenceEngine(controller, max_batch_size=len(ids), legacy=True)
    sampling = SamplingParams(
        temperature=1.0, top_k=0, top_p=0.0, num_tokens_to_generate=params.max_new_tokens,
        termination_id=-1,
    )  # fmt: skip
    requests = [
        InferenceRequest(
            request_id=n,
            prompt="",
            sampling_params=sampling,
            prompt_tokens=torch.tensor(i).tolist(),
            arrival_time=0.0,
        )  # fmt: skip
        for n, i in enumerate(ids)
    ]
    done = engine.generate(inference_requests=requests)
    return sum(_generated(r) for r in done)


def _generated(record) -> int:
    """Tokens a finished request generated (megatron-core keeps a list or a tensor)."""
    tokens = getattr(record, "generated_tokens", None)
    if tokens is None:
        return 0
    return int(tokens.numel()) if hasattr(tokens, "numel") else len(tokens)


class _Tokenizer:
    """The little of a megatron tokenizer the controllers read (ids in, no text out)."""

    def __init__(self, policy):
        self.vocab_size = _language_model(policy).vocab_size
        self.eod = -1
        self.pad = 0

    def detokenize(self, ids, *args, **kwargs) -> str:
        return ""

    def tokenize(self, text):
        return []

    def offsets(self, ids, text):
        return []


if __name__ == "__main__":  # pragma: no cover - imported by benchmarks/grpo_shaped.py
    sys.exit("run through benchmarks/grpo_shaped.py --parts mcore")
