"""`environment.kind: single_turn`: one generation per prompt, every token the policy's (the
rollouts rlflow made before environments existed, unchanged)."""

from __future__ import annotations

from rlflow.environment.base import Environment, EnvRollouts
from rlflow.generation.base import Completion


class SingleTurn(Environment):
    def __init__(self, encoder):
        self.encoder = encoder

    def rollout(self, backend, prompts, samples, params) -> EnvRollouts:
        completions = backend.generate(prompts, params)
        texts = [self.encoder.decode(c.token_ids) for c in completions]
        return EnvRollouts(completions, texts)

    def reference(self, sample, prompt) -> Completion:
        from rlflow.data.prompts import reference_completion

        ids = self.encoder.completion_ids(reference_completion(sample))
        return Completion(ids, [0.0] * len(ids), "stop")
