"""What a rollout returns: one ``RolloutSample`` per (prompt, sample) pair, in a ``RolloutBatch``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Optional

from megatron_cascade.rollout.params import SamplingParams

FinishReason = Literal["stop", "length"]


@dataclass
class RolloutSample:
    """One generated response.

    Attributes:
        prompt_index: index of the prompt in the ``prompts`` given to ``generate``.
        sample_index: which of the ``n`` samples of that prompt (0..n-1).
        prompt_ids: the prompt's token ids.
        response_ids: generated token ids, the stop token (or the token completing a stop string)
            included.
        response_logprobs: per response token, ``log_softmax(logits / T)[token]`` over the whole
            padded vocabulary, float32 nats: exactly what the trainer computes with the same
            temperature (T = 1 for greedy). This is the value to compare against in training.
        sampled_logprobs: per response token, the log-prob under the distribution actually sampled
            from: temperature, padded-vocabulary ids removed, top-k then top-p, renormalised
            (0.0 for greedy: the distribution is a point mass).
        finish_reason: "stop" (stop token or string) or "length" (``max_new_tokens`` or the
            model's maximum sequence length reached).
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"


@dataclass
class GenerationStats:
    """How a paged ``generate`` call ran on this rank.

    Attributes:
        steps: forwards run (each one step of every live request), dummy ones included.
        dummy_steps: forwards without work of its own, run in step with the expert-parallel group.
        peak_requests: most requests live in one step.
        kv_cache_bytes: bytes of the KV block buffer allocated (dummy block included).
        preemptions: requests taken out of the cache for lack of blocks (KV on demand), each
            prefilled again later from its prompt + response so far.
        recomputed_tokens: response tokens prefilled again after preemptions.
    """

    steps: int = 0
    dummy_steps: int = 0
    peak_requests: int = 0
    kv_cache_bytes: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0

    def add(self, other: Optional["GenerationStats"]) -> None:
        """Fold in another call's stats (a multi-turn rollout's turns): counts add, peaks take the max."""
        if other is None:
            return
        self.steps += other.steps
        self.dummy_steps += other.dummy_steps
        self.preemptions += other.preemptions
        self.recomputed_tokens += other.recomputed_tokens
        self.peak_requests = max(self.peak_requests, other.peak_requests)
        self.kv_cache_bytes = max(self.kv_cache_bytes, other.kv_cache_bytes)


@dataclass
class RolloutBatch:
    """All samples of one ``generate`` call, prompt-major: prompt 0 samples 0..n-1, prompt 1, ...

    ``stats`` describes the paged generator's run (None for the static reference path).
    """

    samples: list[RolloutSample]
    params: SamplingParams
    stats: Optional[GenerationStats] = None

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[RolloutSample]:
        return iter(self.samples)

    def __getitem__(self, i: int) -> RolloutSample:
        return self.samples[i]

    def for_prompt(self, prompt_index: int) -> list[RolloutSample]:
        """The ``n`` samples of one prompt (a GRPO group)."""
        return [s for s in self.samples if s.prompt_index == prompt_index]
