"""A reward's ``preflight`` hook runs when a stage builds its rewards, before the first step (the code
reward's sandbox refuses there, naming what is missing, instead of failing every sample of a step)."""

from __future__ import annotations

import os
import sys

import pytest

from megatron_cascade.stages.rollout_scoring import build_domain_rewards
from megatron_cascade.config.schema import DomainConfig, RewardSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def test_preflight_runs_when_rewards_are_built():
    domains = {"svc": DomainConfig(reward=RewardSpec(name="exploding_reward:needs_a_service", kwargs={}))}
    with pytest.raises(RuntimeError, match="preflight refused"):
        build_domain_rewards(domains, ["svc"])


def test_rewards_without_preflight_build():
    domains = {"m": DomainConfig(reward=RewardSpec(name="math"))}
    assert set(build_domain_rewards(domains, ["m"])) == {"m"}


def test_a_sandbox_refusal_names_the_domain_and_the_command_line_override(monkeypatch):
    """Before: the refusal gave only the YAML form (`kwargs: {allow_unsafe_sandbox: true}`), and a user
    had to work out `domains.code.reward.kwargs.allow_unsafe_sandbox=true` (issue 28)."""
    import pytest

    from megatron_cascade.rewards import sandbox

    monkeypatch.setattr(sandbox, "isolation_problem", lambda *args, **kwargs: "the trainer does not run as root")
    domains = {"code": DomainConfig(reward=RewardSpec(name="code"))}
    with pytest.raises(sandbox.SandboxUnavailableError) as info:
        build_domain_rewards(domains, ["code"])
    message = str(info.value)
    assert message.startswith("domains.code.reward: code sandbox unavailable: the trainer does not run as root")
    assert message.endswith("On the command line: domains.code.reward.kwargs.allow_unsafe_sandbox=true")
