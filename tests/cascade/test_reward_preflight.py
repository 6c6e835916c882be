"""A reward's ``preflight`` hook runs when a stage builds its rewards, before the first step (the code
reward's sandbox refuses there, naming what is missing, instead of failing every sample of a step)."""

from __future__ import annotations

import os
import sys

import pytest

from megatron_cascade.cascade.scoring import build_domain_rewards
from megatron_cascade.config.schema import DomainConfig, RewardSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def test_preflight_runs_when_rewards_are_built():
    domains = {"svc": DomainConfig(reward=RewardSpec(name="exploding_reward:needs_a_service", kwargs={}))}
    with pytest.raises(RuntimeError, match="preflight refused"):
        build_domain_rewards(domains, ["svc"])


def test_rewards_without_preflight_build():
    domains = {"m": DomainConfig(reward=RewardSpec(name="math"))}
    assert set(build_domain_rewards(domains, ["m"])) == {"m"}
