"""How a rollout is made: one generation (`single_turn`) or a multi-turn trajectory where the
policy calls tools and the environment answers (`tool_scenes`); the recipe's `environment`
section picks one (`rlflow.environment.factory.make_environment`; docs/environments.md)."""
