"""Score responses with each domain's reward, once per model replica, and share the scores.

All tensor/pipeline-parallel ranks of a replica hold the same responses; only the replica's first
rank runs the verifiers (code runs in the sandbox once, not once per TP rank) and broadcasts.

``score_responses`` scores a finished list; ``RolloutScorer`` scores each sample the moment
generation finishes it (``generate(..., on_finished=scorer.on_finished)``), in a reward worker
pool while decoding goes on, so that after generation only the stragglers are waited for.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_cascade.config.schema import DomainConfig
from megatron_cascade.rewards import build_reward, score_batch
from megatron_cascade.rewards.scoring import ScoringPool, finalize_flags
from megatron_cascade.rollout import RolloutSample

log = logging.getLogger(__name__)


def build_domain_rewards(domains: dict[str, DomainConfig], names) -> dict:
    """The configured reward of each named domain (unknown reward or kwarg: a clear error now). A
    reward with a ``preflight`` hook checks what it needs now, before the first step: the code
    reward's sandbox refuses here, naming what is missing, rather than as errors in every step."""
    rewards = {name: build_reward(domains[name].reward.name, dict(domains[name].reward.kwargs)) for name in names}
    for reward in rewards.values():
        preflight = getattr(reward.fn, "preflight", None)
        if preflight is not None:
            preflight(**reward.kwargs)
    return rewards


def _model_parallel_source() -> tuple[bool, object, int]:
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    src = dist.get_global_rank(group, 0) if dist.get_world_size(group) > 1 else dist.get_rank()
    return dist.get_rank() == src, group, src


def score_responses(rewards: dict, domains: dict[str, DomainConfig], responses: list[str], rows: list[dict],
                    row_domains: list[str]) -> tuple[torch.Tensor, int, float]:
    """Scores [N] (float64, in [0, 1]), the number of reward errors, and seconds spent; collective
    over the model-parallel group."""
    is_source, group, src = _model_parallel_source()
    out = torch.zeros(len(responses) + 1, dtype=torch.float64)
    start = time.perf_counter()
    if is_source:
        for domain in sorted(set(row_domains)):
            index = [i for i, d in enumerate(row_domains) if d == domain]
            scores, errors = score_batch(rewards[domain], [responses[i] for i in index], [rows[i] for i in index],
                                         timeout_s=domains[domain].reward.timeout_s)
            out[index] = torch.tensor(scores, dtype=torch.float64)
            out[-1] += errors
            if errors:
                log.warning("reward %s: %d of %d responses errored or timed out (scored 0)",
                            domains[domain].reward.name, errors, len(index))
    if dist.get_world_size(group) > 1:
        dist.broadcast(out, src=src, group=group)
    return out[:-1], int(out[-1]), time.perf_counter() - start


class RolloutScorer:
    """Scores rollout samples as generation finishes them; ``collect`` returns what
    ``score_responses`` would for the same samples (same scores, errors and warnings).

    Args:
        rewards: reward per domain; ``domains``: their configs (``reward.timeout_s``).
        tokenizer: decodes ``response_ids`` into the text the reward reads.
        prompt_rows, prompt_domains: per prompt index of the ``generate`` call, its data row and domain.
        max_workers: reward calls live at once (default ``os.cpu_count()``, as ``score_batch``).

    Only the model-parallel source rank scores (other ranks ignore ``on_finished``); ``collect``
    is collective over the model-parallel group (the source broadcasts). Use it as a context
    manager so that an exception during generation still ends the pool's dispatcher.
    """

    def __init__(self, rewards: dict, domains: dict[str, DomainConfig], tokenizer, prompt_rows: Sequence[dict],
                 prompt_domains: Sequence[str], *, max_workers: Optional[int] = None) -> None:
        self.rewards, self.domains, self.tokenizer = rewards, domains, tokenizer
        self.prompt_rows, self.prompt_domains = list(prompt_rows), list(prompt_domains)
        self.is_source, self.group, self.src = _model_parallel_source()
        self.pool = ScoringPool(max_workers) if self.is_source else None
        self.tickets: dict[int, int] = {}  # sample index -> index in the pool's results

    def __enter__(self) -> "RolloutScorer":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.close()

    def on_finished(self, sample_index: int, sample: RolloutSample) -> None:
        """Queue one finished sample for scoring (``generate``'s ``on_finished`` hook)."""
        if self.pool is None or sample_index in self.tickets:
            return
        domain = self.prompt_domains[sample.prompt_index]
        self.tickets[sample_index] = self.pool.submit(
            self.rewards[domain], self.tokenizer.decode(sample.response_ids), self.prompt_rows[sample.prompt_index],
            timeout_s=self.domains[domain].reward.timeout_s)

    def collect(self, samples: Sequence[RolloutSample]) -> tuple[torch.Tensor, int, float]:
        """Scores [N] (float64, in [0, 1]) of ``samples`` (the ``generate`` result), the number of
        reward errors, and the seconds waited here (the stragglers); collective over the
        model-parallel group. Samples ``on_finished`` never saw are scored now."""
        scores, errored, seconds = self.collect_flags(samples)
        return scores, int(errored.sum()), seconds

    def collect_flags(self, samples: Sequence[RolloutSample]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """As :meth:`collect`, with per sample whether its reward errored or timed out ([N] bool,
        the same on every model-parallel rank) instead of the count."""
        start = time.perf_counter()
        n = len(samples)
        out = torch.zeros(2 * n, dtype=torch.float64)  # scores, then error flags: one broadcast
        if self.pool is not None:
            for i, sample in enumerate(samples):
                self.on_finished(i, sample)
            raw = self.pool.results()
            row_domains = [self.prompt_domains[s.prompt_index] for s in samples]
            for domain in sorted(set(row_domains)):
                index = [i for i, d in enumerate(row_domains) if d == domain]
                name = getattr(self.rewards[domain], "name", repr(self.rewards[domain]))
                scores, errored = finalize_flags([raw[self.tickets[i]] for i in index], name)
                out[index] = torch.tensor(scores, dtype=torch.float64)
                out[[n + i for i in index]] = torch.tensor(errored, dtype=torch.float64)
                if any(errored):
                    log.warning("reward %s: %d of %d responses errored or timed out (invalid samples)",
                                self.domains[domain].reward.name, sum(errored), len(index))
        if dist.get_world_size(self.group) > 1:
            dist.broadcast(out, src=self.src, group=self.group)
        return out[:n], out[n:] > 0, time.perf_counter() - start


class RewardErrorRateExceeded(RuntimeError):
    """More of a step's samples had a failed reward than ``rewards.max_error_frac`` allows."""


def check_error_fraction(errored: torch.Tensor, sample_domains: Sequence[str], domains: dict[str, DomainConfig],
                         stage_domains: Sequence[str], max_error_frac: float, group=None) -> tuple[float, float]:
    """All-reduce this rank's reward errors over ``group`` (the data-parallel ranks) and raise
    :class:`RewardErrorRateExceeded` on every rank when the global fraction exceeds ``max_error_frac``.

    Args:
        errored: [N] bool, per local sample whether its reward failed.
        sample_domains: [N] the domain of each sample; ``stage_domains``: every domain of the stage,
            in the same order on every rank (the all-reduced vector is indexed by it).
    Returns:
        (global errors, global samples).
    """
    names = sorted(stage_domains)
    counts = torch.zeros(2 * len(names), dtype=torch.float64)  # errors per domain, samples per domain
    for i, domain in enumerate(sample_domains):
        k = names.index(domain)
        counts[k] += float(errored[i])
        counts[len(names) + k] += 1.0
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    errors, total = counts[:len(names)], counts[len(names):]
    n_errors, n_samples = float(errors.sum()), float(total.sum())
    if n_samples and n_errors / n_samples > max_error_frac:
        failed = ", ".join(f"{d} (reward {domains[d].reward.name}): {int(errors[k])}/{int(total[k])}"
                           for k, d in enumerate(names) if errors[k] > 0)
        raise RewardErrorRateExceeded(
            f"{int(n_errors)} of {int(n_samples)} samples of this step had a reward that errored or timed out "
            f"({n_errors / n_samples:.3f} > rewards.max_error_frac={max_error_frac}); failed: {failed}. "
            "Stopped before the optimizer step: check the reward (server, sandbox, timeout_s) and resume, "
            "or raise rewards.max_error_frac.")
    return n_errors, n_samples
