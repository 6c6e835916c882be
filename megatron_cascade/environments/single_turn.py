"""``single_turn``: today's rollouts as environments — one model turn, then done; the score is the
domain's reward of the response (the reward config is unchanged). Every domain's default."""

from __future__ import annotations

from typing import Any, Sequence

from megatron_cascade.environments.base import EnvStep, Environment, register_environment


@register_environment("single_turn")
class SingleTurnEnvironment(Environment):
    """The episode ends after the model's first turn; nothing is appended."""

    one_turn = True

    def step(self, state: Any, action_ids: Sequence[int], action_text: str) -> EnvStep:
        return EnvStep(done=True)
