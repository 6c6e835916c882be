"""Score responses with each domain's reward, once per model replica, and share the scores.

All tensor/pipeline-parallel ranks of a replica hold the same responses; only the replica's first
rank runs the verifiers (code runs in the sandbox once, not once per TP rank) and broadcasts.

``score_responses`` scores a finished list; ``RolloutScorer`` scores each sample the moment
generation finishes it (``generate(..., on_finished=scorer.on_finished)``), in a reward worker
pool while decoding goes on, so that after generation only the stragglers are waited for.

A domain with ``reward.reasoning_parser: think`` has its reward see only the answer after the
reasoning (:mod:`megatron_cascade.rewards.reasoning`); reasoning that never closed scores 0 without
a reward call and is counted (``RolloutScorer.reasoning_unfinished``). A group reward
(:func:`megatron_cascade.rewards.registry.is_group_reward`, e.g. ``pairwise_judge``) is called once
per prompt with all of its responses: as soon as the last one finishes when the scorer knows the
group size, else in ``collect``.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_cascade.config.schema import DomainConfig
from megatron_cascade.environments.episode import EpisodeSample, episode_record
from megatron_cascade.rewards import build_reward, score_batch
from megatron_cascade.rewards.reasoning import ReasoningParser, build_reasoning_parser
from megatron_cascade.rewards.sandbox import SandboxUnavailableError
from megatron_cascade.rewards.registry import EPISODE_RECORD, is_group_reward, score_group
from megatron_cascade.rewards.scoring import ScoringPool, finalize_outcomes
from megatron_cascade.rollout import RolloutSample
from megatron_cascade.rollout.replica_groups import model_parallel_source

log = logging.getLogger(__name__)


def build_domain_rewards(domains: dict[str, DomainConfig], names) -> dict:
    """The configured reward of each named domain (unknown reward or kwarg: a clear error now). A
    reward with a ``preflight`` hook checks what it needs now, before the first step: the code
    reward's sandbox refuses here, naming what is missing, rather than as errors in every step."""
    rewards = {name: build_reward(domains[name].reward.name, dict(domains[name].reward.kwargs)) for name in names}
    for name, reward in rewards.items():
        preflight = getattr(reward.fn, "preflight", None)
        if preflight is None:
            continue
        try:
            preflight(**reward.kwargs)
        except SandboxUnavailableError as exc:  # name the domain, and the override as typed on the command line
            raise SandboxUnavailableError(f"domains.{name}.reward: {exc} On the command line: "
                                          f"domains.{name}.reward.kwargs.allow_unsafe_sandbox=true") from None
    return rewards


def reasoning_parser(domain: DomainConfig) -> Optional[ReasoningParser]:
    """The reasoning parser of ``domain`` (``reward.reasoning_parser``), or None."""
    spec = domain.reward
    return build_reasoning_parser(spec.reasoning_parser, spec.reasoning_markers)


def _model_parallel_source(group=None) -> tuple[bool, object, int]:
    """The source of ``group`` (default: the training layout's model-parallel group)."""
    from megatron.core import parallel_state as ps

    return model_parallel_source(group if group is not None else ps.get_model_parallel_group())


def score_responses(rewards: dict, domains: dict[str, DomainConfig], responses: list[str], rows: list[dict],
                    row_domains: list[str]) -> tuple[torch.Tensor, int, float]:
    """Scores [N] (float64, in [0, 1]), the number of reward errors, and seconds spent; collective
    over the model-parallel group. Unfinished reasoning scores 0 (not an error); a group reward is
    called per response (a group of one)."""
    is_source, group, src = _model_parallel_source()
    out = torch.zeros(len(responses) + 1, dtype=torch.float64)
    start = time.perf_counter()
    if is_source:
        for domain in sorted(set(row_domains)):
            parser = reasoning_parser(domains[domain])
            answers = {}  # response index -> what the reward reads (unfinished reasoning: not scored, 0)
            for i in (i for i, d in enumerate(row_domains) if d == domain):
                parsed = parser.parse(responses[i]) if parser else None
                if parsed is None or parsed.finished:
                    answers[i] = parsed.answer if parsed else responses[i]
            index = list(answers)
            scores, errors = score_batch(rewards[domain], [answers[i] for i in index], [rows[i] for i in index],
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
        group_size: responses per prompt (``samples_per_prompt``); when given, a group reward is
            called as soon as a prompt's last response finishes, else in ``collect``.
        model_parallel_group: the generating replica's model-parallel group (a decode layout's);
            default the training layout's.

    Only the model-parallel source rank scores (other ranks ignore ``on_finished``); ``collect``
    is collective over the model-parallel group (the source broadcasts). Use it as a context
    manager so that an exception during generation still ends the pool's dispatcher.

    After ``collect``/``collect_flags``, ``reasoning_unfinished`` ([N] bool, every model-parallel
    rank) flags the samples whose reasoning never closed (scored 0 by the reasoning parser), and
    ``response_faults`` ([N] bool) those that broke their own scoring (scored 0 as a verdict:
    :mod:`megatron_cascade.rewards.outcome`; not errors).
    """

    def __init__(self, rewards: dict, domains: dict[str, DomainConfig], tokenizer, prompt_rows: Sequence[dict],
                 prompt_domains: Sequence[str], *, max_workers: Optional[int] = None,
                 group_size: Optional[int] = None, model_parallel_group=None) -> None:
        self.rewards, self.domains, self.tokenizer = rewards, domains, tokenizer
        self.prompt_rows, self.prompt_domains = list(prompt_rows), list(prompt_domains)
        self.group_size = group_size
        self.is_source, self.group, self.src = _model_parallel_source(model_parallel_group)
        self.pool = ScoringPool(max_workers) if self.is_source else None
        self.tickets: dict[int, int] = {}  # sample index -> index in the pool's results
        self.seen: set[int] = set()  # sample indices handed to on_finished
        self.parsers = {d: reasoning_parser(domains[d]) for d in set(self.prompt_domains)}
        self.unfinished: set[int] = set()  # sample indices whose reasoning never closed
        self.waiting: dict[int, list[tuple[int, str]]] = {}  # group reward: prompt -> (sample, answer)
        self.arrived: dict[int, int] = {}  # group reward: prompt -> samples seen (unfinished included)
        self.group_tickets: dict[int, tuple[int, list[int]]] = {}  # prompt -> (pool index, sample indices)
        self.reasoning_unfinished = torch.zeros(0, dtype=torch.bool)
        self.response_faults = torch.zeros(0, dtype=torch.bool)

    def __enter__(self) -> "RolloutScorer":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.close()

    def on_finished(self, sample_index: int, sample: RolloutSample) -> None:
        """Queue one finished sample for scoring (``generate``'s ``on_finished`` hook)."""
        if self.pool is None or sample_index in self.seen:
            return
        self.seen.add(sample_index)
        prompt = sample.prompt_index
        domain = self.prompt_domains[prompt]
        answer = self._answer(domain, sample_index, sample)
        if is_group_reward(self.rewards[domain]):
            self.arrived[prompt] = self.arrived.get(prompt, 0) + 1
            if answer is not None:
                self.waiting.setdefault(prompt, []).append((sample_index, answer))
            if self.group_size is not None and self.arrived[prompt] >= self.group_size:
                self._submit_group(prompt)
            return
        if answer is None:
            return
        self.tickets[sample_index] = self.pool.submit(
            self.rewards[domain], answer, self._row(prompt, sample), timeout_s=self.domains[domain].reward.timeout_s)

    def _row(self, prompt: int, sample: RolloutSample) -> dict:
        """The ``sample`` the reward reads: the prompt's data row, plus for an episode the runner's
        record of it (``EPISODE_RECORD``: which text the model wrote, turn by turn)."""
        row = self.prompt_rows[prompt]
        if not isinstance(sample, EpisodeSample):
            return row
        parser = self.parsers[self.prompt_domains[prompt]]
        return {**row, EPISODE_RECORD: episode_record(sample, self.tokenizer, parser)}

    def _answer(self, domain: str, sample_index: int, sample: RolloutSample) -> Optional[str]:
        """The text the reward reads: the decoded response, or its answer after the reasoning; None
        (and the sample marked unfinished) when the reasoning never closed."""
        text = self.tokenizer.decode(sample.response_ids)
        parser = self.parsers[domain]
        if parser is None:
            return text
        parsed = parser.parse(text, opened_in_prompt=parser.prompt_opens(self.tokenizer, sample.prompt_ids))
        if not parsed.finished:
            self.unfinished.add(sample_index)
        return parsed.answer if parsed.finished else None

    def _submit_group(self, prompt: int) -> None:
        """One call of the group reward with every finished answer of ``prompt`` (none left: no call)."""
        if prompt in self.group_tickets:
            return
        members = self.waiting.pop(prompt, [])
        if not members:
            return
        domain = self.prompt_domains[prompt]
        call = _GroupCall(self.rewards[domain])
        ticket = self.pool.submit(call, tuple(a for _, a in members), self.prompt_rows[prompt],
                                  timeout_s=self.domains[domain].reward.timeout_s * len(members))
        self.group_tickets[prompt] = (ticket, [i for i, _ in members])

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
        out = torch.zeros(4 * n, dtype=torch.float64)  # scores, error, unfinished, fault flags: one broadcast
        if self.pool is not None:
            for i, sample in enumerate(samples):
                self.on_finished(i, sample)
            for prompt in list(self.waiting):  # group size unknown: every group goes out now
                self._submit_group(prompt)
            raw = self._raw_per_sample(self.pool.results())
            row_domains = [self.prompt_domains[s.prompt_index] for s in samples]
            for domain in sorted(set(row_domains)):
                index = [i for i, d in enumerate(row_domains) if d == domain and i not in self.unfinished]
                name = getattr(self.rewards[domain], "name", repr(self.rewards[domain]))
                scores, errored, faulted = finalize_outcomes([raw[i] for i in index], name)
                out[index] = torch.tensor(scores, dtype=torch.float64)
                out[[n + i for i in index]] = torch.tensor(errored, dtype=torch.float64)
                out[[3 * n + i for i in index]] = torch.tensor(faulted, dtype=torch.float64)
                if any(errored):
                    log.warning("reward %s: %d of %d responses errored or timed out (invalid samples)",
                                self.domains[domain].reward.name, sum(errored), len(index))
            out[[2 * n + i for i in sorted(self.unfinished)]] = 1.0
            if self.unfinished:
                log.info("reasoning parser: %d of %d responses never closed their reasoning (scored 0)",
                         len(self.unfinished), n)
        if dist.get_world_size(self.group) > 1:
            dist.broadcast(out, src=self.src, group=self.group)
        self.reasoning_unfinished = out[2 * n:3 * n] > 0
        self.response_faults = out[3 * n:] > 0
        return out[:n], out[n:2 * n] > 0, time.perf_counter() - start

    def _raw_per_sample(self, pool_raw: list) -> dict[int, object]:
        """Per scored sample index its raw reward value (a group call's list spread over its members;
        a failed or malformed group call is each member's error)."""
        raw: dict[int, object] = {i: pool_raw[t] for i, t in self.tickets.items()}
        for ticket, members in self.group_tickets.values():
            value = pool_raw[ticket]
            if not isinstance(value, BaseException) and (not isinstance(value, list) or len(value) != len(members)):
                value = ValueError(f"group reward returned {type(value).__name__} "
                                   f"(expected a list of {len(members)} scores)")
            raw.update((i, value if isinstance(value, BaseException) else value[k]) for k, i in enumerate(members))
        return raw


class _GroupCall:
    """A group reward as a :class:`ScoringPool` item: ``(answers tuple, row) -> list of raw values``."""

    def __init__(self, reward) -> None:
        self.reward = reward
        self.name = getattr(reward, "name", repr(reward))

    def __call__(self, answers: tuple, row: dict) -> list:
        return score_group(self.reward, list(answers), row)


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
