"""``environment`` reward: 0 for every transcript — the episode's score is its environment's turn rewards.

For domains whose environment decides the reward itself (``swe``: the hidden tests at submission,
returned as the final step's ``EnvStep.reward``), so that the transcript is not scored twice.
"""

from __future__ import annotations

from megatron_cascade.rewards.registry import register_reward


@register_reward("environment")
def environment_reward(response: str, sample: dict) -> float:
    """0.0: the environment's turn rewards are the whole score."""
    return 0.0
