"""Verifiable rewards for Cascade RL: a registry of plain ``(response, sample) -> float`` functions.

Public API::

    get_reward(name) -> Reward
    build_reward(spec_name, kwargs) -> Reward
    register_reward(name)                      # decorator, fills REWARDS
    score_batch(reward_fn, responses, samples, *, timeout_s, max_workers) -> (scores, errors)
    CodeSandbox(...).run(program, limits) / .run_many(programs, limits)

Built-in rewards (imported lazily on first lookup): ``math``, ``code``,
``instruction_following``, ``structured_output``, ``multiple_choice``, ``reward_model``.
"""

from megatron_cascade.rewards.registry import (
    REWARDS,
    BoundReward,
    Reward,
    build_reward,
    get_reward,
    register_reward,
)
from megatron_cascade.rewards.scoring import score_batch

__all__ = [
    "REWARDS",
    "BoundReward",
    "Reward",
    "build_reward",
    "get_reward",
    "register_reward",
    "score_batch",
]
