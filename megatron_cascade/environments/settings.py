"""A stage's environments per domain, from the config (``domains.<d>.environment``), and how their
episodes' outcomes adjust the scores the domain rewards gave."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from megatron_cascade.config.model import ConfigError
from megatron_cascade.config.schema import DomainConfig
from megatron_cascade.environments.base import build_environment, row_checker
from megatron_cascade.environments.episode import EpisodeSample, EpisodeSettings
from megatron_cascade.tokenizers.base import Tokenizer


def domain_episode_settings(domains: Mapping[str, DomainConfig], names: Sequence[str], tokenizer: Tokenizer,
                            max_new_tokens: int) -> dict[str, EpisodeSettings]:
    """Per named domain its environment and budgets (``max_new_tokens``: per turn). Built now: an
    unknown name or kwarg, or a tool that cannot load, is a ``ConfigError`` naming
    ``domains.<d>.environment`` before the first step."""
    out = {}
    for name in names:
        spec = domains[name].environment
        try:
            env = build_environment(spec.name, spec.kwargs, tokenizer)
        except (KeyError, TypeError, ValueError, ImportError) as exc:
            raise _config_error(name, exc) from exc
        turns = 1 if env.one_turn else spec.max_turns
        budget = spec.max_episode_tokens or turns * max_new_tokens
        out[name] = EpisodeSettings(env, turns, budget, spec.step_timeout_s)
    return out


def domain_row_check(name: str, domain: DomainConfig) -> Callable[[dict], None]:
    """The check of a data row of domain ``name`` by its environment (``Environment.check_row``),
    for the data loader; an unknown environment is a ``ConfigError`` naming ``domains.<d>.environment``."""
    spec = domain.environment
    try:
        return row_checker(spec.name, spec.kwargs)
    except (KeyError, TypeError, ImportError) as exc:
        raise _config_error(name, exc) from exc


def _config_error(name: str, exc: Exception) -> ConfigError:
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    return ConfigError(f"domains.{name}.environment: {message}")


def episode_scores(samples: Sequence[EpisodeSample], scores: torch.Tensor,
                   errored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The episodes' scores: the reward of the transcript plus the environment's turn rewards; an
    episode whose environment step timed out or that broke its environment (``response_fault``)
    scores 0 (a valid sample: the tool hung, the turn was the problem), one whose step raised
    otherwise is a failed reward (``errored``, invalid sample)."""
    scores, errored = scores.clone(), errored.clone()
    for i, s in enumerate(samples):
        if s.timed_out or s.response_fault is not None:
            scores[i], errored[i] = 0.0, False
        elif s.env_error is not None:
            scores[i], errored[i] = 0.0, True
        elif s.turn_rewards and not errored[i]:
            scores[i] += float(sum(s.turn_rewards))
    return scores, errored
