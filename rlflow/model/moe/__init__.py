"""Mixture-of-experts: the grouped experts (experts.py) and router replay (routing.py), and the
mixin a family with expert layers takes (`class F(MixtureOfExperts, Base)`)."""


class MixtureOfExperts:
    """Mixed into a family whose decoder layers are mixture-of-experts: megatron-bridge's provider
    gets rlflow's expert settings (rlflow.model.moe.experts) after the family's own."""

    def configure_provider(self, provider, hf_config, model_cfg) -> None:
        from rlflow.model.moe import experts

        super().configure_provider(provider, hf_config, model_cfg)  # type: ignore[misc]
        experts.configure_provider(provider, hf_config, model_cfg)
