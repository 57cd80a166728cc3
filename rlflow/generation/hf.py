"""Reference backend: HF transformers `generate` on the policy's weights (exported via the bridge).

Used for parity checks against the Megatron backend and as a fallback (`generation.backend: hf`).
It keeps its own HF copy of the model; `refresh_weights` re-exports the Megatron policy through
megatron-bridge into that copy after every optimizer step.
"""

from __future__ import annotations

import time

import torch

from rlflow.generation.base import Completion, GenerationBackend, SamplingParams
from rlflow.model import family as families
from rlflow.model.build import Policy, export_hf_state_dict
from rlflow.model.media import Media, Prompt


def load_hf_model(checkpoint, dtype: torch.dtype, device):
    """The checkpoint as its family's transformers class (SDPA attention), in eval mode."""
    cls = families.of_checkpoint(checkpoint).hf_class()
    model = cls.from_pretrained(str(checkpoint), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def copy_policy_into(model, policy: Policy) -> None:
    """Overwrite an HF model's weights with the Megatron policy's current ones (all must match)."""
    state = policy.family.hf_state_dict(export_hf_state_dict(policy))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [
        m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)
    ]
    if missing or unexpected:
        raise RuntimeError(
            f"HF weight names do not line up: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


class HFGeneration(GenerationBackend):
    name = "hf"

    def __init__(self, policy: Policy, pad_token_id: int, max_batch_size: int):
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.device = policy.device
        self.model = load_hf_model(policy.checkpoint, policy.dtype, self.device)
        self.refresh_weights(0)

    def refresh_weights(self, version: int | None = None) -> float:
        start = time.perf_counter()
        copy_policy_into(self.model, self.policy)
        self.weight_version = self.next_version(version)
        return time.perf_counter() - start

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Completion]:
        out, size = [], self.max_batch_size or len(prompts)
        for start in range(0, len(prompts), size):
            out += self._batch(prompts[start : start + size], params, params.seed + start)
        return out

    @torch.no_grad()
    def _batch(self, prompts: list[Prompt], params: SamplingParams, seed: int) -> list[Completion]:
        rows = [self.policy.prompt_ids(p) for p in prompts]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention[i, width - len(row) :] = 1
        media = Media.concat([p.media for p in prompts], self.device)
        kwargs = {k: v for k, v in vars(media).items() if v is not None}
        family_inputs = self.policy.family.hf_generate_inputs(input_ids, self.policy.media_tokens)
        kwargs |= {k: v.to(self.device) for k, v in family_inputs.items()}
        greedy = params.temperature == 0
        torch.manual_seed(seed)
        result = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            **kwargs,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.max_new_tokens if params.ignore_eos else 0,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else (params.top_k or None),
            eos_token_id=None if params.ignore_eos else list(params.stop_token_ids),
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_tokens = result.sequences[:, width:]
        logprobs = torch.stack([torch.log_softmax(step.float(), -1) for step in result.logits], 1)
        chosen = logprobs.gather(2, new_tokens[:, : logprobs.shape[1], None])[..., 0]
        return [_completion(t, lp, params) for t, lp in zip(new_tokens.tolist(), chosen.tolist())]


def _completion(tokens: list[int], logprobs: list[float], params: SamplingParams) -> Completion:
    if not params.ignore_eos:
        for i, token in enumerate(tokens):
            if token in params.stop_token_ids:
                return Completion(tokens[: i + 1], logprobs[: i + 1], "stop")
    return Completion(tokens, logprobs, "length")
