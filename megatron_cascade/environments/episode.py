"""One episode's tokens as it grows, and the ``RolloutSample`` it becomes.

Token layout (what packing and the trainer see): ``prompt_ids`` then ``response_ids``, where the
response is every token after the prompt in order — model turns as sampled (their end-of-turn token
included) and observations as the environment returned them. ``response_mask[i]`` is 1 for a sampled
token, 0 for an observation token; ``response_logprobs``/``sampled_logprobs`` are the sampler's on
sampled tokens and 0.0 on observation tokens (masked out of the loss, so never compared).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_cascade.environments.base import EnvStep, Environment
from megatron_cascade.rewards.reasoning import ReasoningParser
from megatron_cascade.rollout.batch import RolloutSample
from megatron_cascade.tokenizers.base import Tokenizer


@dataclass
class EpisodeSample(RolloutSample):
    """A finished episode as a rollout sample (see the module docstring for the token layout).

    Attributes:
        response_mask: [len(response_ids)] 1 = sampled by the model (trained on), 0 = observation.
        turns: model turns taken.
        turn_rewards: per environment step, its reward (added to the episode's score).
        timed_out: an environment step overran ``environment.step_timeout_s`` (the episode scores 0).
        env_error: the exception text of a failing environment step (the reward counts as failed).
        response_fault: the text of a :class:`~megatron_cascade.rewards.outcome.ResponseFault` an
            environment step raised: the model's turn made the step impossible (the episode scores 0,
            a verdict, not an invalid sample).
        metrics: environment metrics summed over the episode's steps (``EnvStep.metrics``).
        turn_spans: per model turn, its ``[start, end)`` in ``response_ids`` (the runner's record of
            which tokens the model wrote; see :func:`episode_record`).

    ``finish_reason`` is "stop" when the environment ended the episode, "length" when a turn hit its
    token budget or the episode its turn / token budget.
    """

    response_mask: list[int] = field(default_factory=list)
    turns: int = 0
    turn_rewards: list[float] = field(default_factory=list)
    timed_out: bool = False
    env_error: Optional[str] = None
    response_fault: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)


def episode_record(sample: EpisodeSample, tokenizer: Tokenizer,
                   parser: Optional[ReasoningParser] = None) -> dict[str, Any]:
    """What a reward reads as ``sample[EPISODE_RECORD]`` (never split from the transcript's text, in
    which the model can write a fake tool response):

    * ``model_turns``: each model turn decoded on its own, as its environment step read it;
    * ``last_turn_answer``: the last model turn after its reasoning when the domain has a reasoning
      ``parser`` ("" when that reasoning never closed), else the whole last turn.
    """
    ids = sample.response_ids
    turns = [tokenizer.decode(ids[start:end]) for start, end in sample.turn_spans]
    last = turns[-1] if turns else ""
    if parser is not None and turns:
        context = list(sample.prompt_ids) + list(ids[:sample.turn_spans[-1][0]])
        last = parser.parse(last, opened_in_prompt=parser.prompt_opens(tokenizer, context)).answer
    return {"model_turns": turns, "last_turn_answer": last}


@dataclass
class EpisodeSettings:
    """The environment of a prompt and its budgets (from the domain's ``environment`` config)."""

    env: Environment
    max_turns: int
    max_episode_tokens: int  # tokens after the prompt, observations included
    step_timeout_s: float


class Episode:
    """An episode in progress on every model-parallel rank (``state`` lives on the source rank only)."""

    def __init__(self, sample: EpisodeSample, settings: EpisodeSettings, row: dict) -> None:
        self.sample, self.settings, self.row = sample, settings, row
        self.state: Any = None
        self.started = False  # ``start`` returned: ``finish`` is owed
        self.released = False  # the runner is done with the episode
        self.done = False
        self._lock = threading.Lock()

    @property
    def context(self) -> list[int]:
        """The tokens the next turn continues."""
        return self.sample.prompt_ids + self.sample.response_ids

    @property
    def tokens_left(self) -> int:
        return self.settings.max_episode_tokens - len(self.sample.response_ids)

    def add_turn(self, turn: RolloutSample) -> None:
        """Append a model turn (its sampled tokens and log-probs, mask 1), cut at what is left of
        the episode's token budget (then its finish reason is "length"). Cutting afterwards is the
        same as a smaller budget: a token's sampling does not depend on the budget."""
        s, keep = self.sample, self.tokens_left
        cut = len(turn.response_ids) > keep
        s.turn_spans.append((len(s.response_ids), len(s.response_ids) + min(keep, len(turn.response_ids))))
        s.response_ids += turn.response_ids[:keep]
        s.response_logprobs += turn.response_logprobs[:keep]
        s.sampled_logprobs += turn.sampled_logprobs[:keep]
        s.response_mask += [1] * min(keep, len(turn.response_ids))
        s.turns += 1
        s.finish_reason = "length" if cut else turn.finish_reason

    def env_step(self, action_ids: list[int], action_text: str) -> EnvStep:
        """Start the episode's environment state on its first step, then step it (worker thread)."""
        if not self.started:
            state = self.settings.env.start(self.row)
            with self._lock:
                self.state, self.started, late = state, True, self.released
            if late:  # the runner gave up on this step while ``start`` ran: release what it made
                self.settings.env.finish(state)
                raise TimeoutError("the episode was abandoned while its environment started")
        return self.settings.env.step(self.state, action_ids, action_text)

    def release(self) -> bool:
        """Mark the episode released; whether ``finish`` is now owed by the caller (``start`` has
        returned; otherwise a ``start`` still running calls ``finish`` itself when it returns)."""
        with self._lock:
            self.released = True
            return self.started

    def apply(self, outcome: "StepOutcome", limit: int) -> None:
        """Apply the environment's answer: end the episode or append its observation (mask 0)."""
        s = self.sample
        if outcome.error is not None or outcome.timed_out or outcome.response_fault is not None:
            s.env_error, s.timed_out, s.finish_reason = outcome.error, outcome.timed_out, "stop"
            s.response_fault = outcome.response_fault
            self.done = True
            return
        s.turn_rewards.append(outcome.reward)
        for key, value in outcome.metrics.items():
            s.metrics[key] = s.metrics.get(key, 0.0) + float(value)
        if outcome.done:
            s.finish_reason, self.done = "stop", True
            return
        obs = list(outcome.observation_ids)
        room = min(self.tokens_left, limit - len(self.context))
        # Out of turns or tokens: the episode is truncated; a trailing observation would predict nothing.
        if s.turns >= self.settings.max_turns or len(obs) + 1 > room:
            s.finish_reason, self.done = "length", True
            return
        s.response_ids += obs
        s.response_logprobs += [0.0] * len(obs)
        s.sampled_logprobs += [0.0] * len(obs)
        s.response_mask += [0] * len(obs)


@dataclass
class StepOutcome:
    """An environment step's result as broadcast to every model-parallel rank (picklable)."""

    observation_ids: list[int] = field(default_factory=list)
    done: bool = True
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    timed_out: bool = False
    error: Optional[str] = None
    response_fault: Optional[str] = None

    @classmethod
    def of(cls, step: EnvStep) -> "StepOutcome":
        if not isinstance(step, EnvStep):
            return cls(error=f"environment step returned {type(step).__name__}, not EnvStep")
        return cls(list(step.observation_ids), bool(step.done), float(step.reward), dict(step.metrics))
