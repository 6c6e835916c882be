"""Score responses with each domain's reward, once per model replica, and share the scores.

All tensor/pipeline-parallel ranks of a replica hold the same responses; only the replica's first
rank runs the verifiers (code runs in the sandbox once, not once per TP rank) and broadcasts.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from megatron_cascade.config.schema import DomainConfig
from megatron_cascade.rewards import build_reward, score_batch

log = logging.getLogger(__name__)


def build_domain_rewards(domains: dict[str, DomainConfig], names) -> dict:
    """The configured reward of each named domain (unknown reward or kwarg: a clear error now)."""
    return {name: build_reward(domains[name].reward.name, dict(domains[name].reward.kwargs)) for name in names}


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
