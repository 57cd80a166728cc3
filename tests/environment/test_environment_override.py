"""`environment_override` (rlflow/environment/factory.py): a program that drives the trainer
in-process (benchmarks/multiturn_step_gpu.py) makes the trainer's rollouts, validation and warm
start use an environment that is no recipe kind, and only while the override is open."""

from __future__ import annotations

import pytest

from rlflow.environment import factory
from rlflow.environment.base import Environment, EnvRollouts
from rlflow.environment.single_turn import SingleTurn
from rlflow.model.processor import PromptEncoder
from tests.tiny import base_recipe


class Fixed(Environment):
    """An environment of the test's own, built with what the factory passes it."""

    def __init__(self, recipe, encoder):
        self.recipe, self.encoder = recipe, encoder

    def rollout(self, backend, prompts, samples, params) -> EnvRollouts:
        raise AssertionError("not called")

    def reference(self, sample, prompt):
        raise AssertionError("not called")


@pytest.fixture(scope="module")
def encoder(tiny_ckpt):
    return PromptEncoder(tiny_ckpt, base_recipe().data)


def test_the_trainer_makes_the_override_environment_while_it_is_open(encoder):
    # the names the trainer's modules call (rollouts; validation and the warm start)
    from rlflow.train import collect, loop

    recipe = base_recipe()
    assert recipe.environment.kind == "single_turn"
    with factory.environment_override(Fixed):
        for make in (collect.make_environment, loop.make_environment):
            made = make(recipe, encoder)
            assert isinstance(made, Fixed)
            assert made.recipe is recipe and made.encoder is encoder
    assert isinstance(collect.make_environment(recipe, encoder), SingleTurn)


def test_the_innermost_override_wins_and_each_closes_even_on_error(encoder):
    recipe = base_recipe()

    class Inner(Fixed):
        pass

    with factory.environment_override(Fixed):
        with pytest.raises(RuntimeError, match="boom"):
            with factory.environment_override(Inner):
                assert isinstance(factory.make_environment(recipe, encoder), Inner)
                raise RuntimeError("boom")
        assert type(factory.make_environment(recipe, encoder)) is Fixed
    assert isinstance(factory.make_environment(recipe, encoder), SingleTurn)
