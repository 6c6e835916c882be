"""Making every model-parallel rank agree on the sampled tokens of a step."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_cascade.rollout.replica_groups import ReplicaGroups
from megatron_cascade.rollout.sampling import SampleOutput


def share_step(out: Optional[SampleOutput], batch_size: int, device: torch.device, groups: ReplicaGroups,
               pipeline: bool = True) -> SampleOutput:
    """The last pipeline stage's TP rank 0 result, on every TP and PP rank of this model replica
    (``pipeline=False``: on the last stage's TP ranks only; the overlapped pipeline sends it on).

    Each TP rank of the last stage samples from identical gathered logits with an identically
    seeded generator, so they already agree; the TP broadcast makes that a guarantee rather than an
    assumption (kernels may differ across devices). The PP broadcast hands the tokens to the
    earlier stages, which have no logits. ``out`` is None on ranks that did not sample.
    """
    packed = pack(out) if out is not None else torch.empty((3, batch_size), dtype=torch.float64, device=device)
    if groups.last and groups.tp_size > 1:
        dist.broadcast(packed, groups.tp_src, group=groups.tp)
    if pipeline and groups.pp_size > 1:
        dist.broadcast(packed, groups.pp_ranks[-1], group=groups.pp)
    return unpack(packed)


def pack(out: SampleOutput) -> torch.Tensor:
    """One float64 message ``[3, B]``: token ids are exact in float64 (< 2**53), log-probs widen losslessly."""
    return torch.stack([out.tokens.to(torch.float64), out.temperature_logprobs.to(torch.float64),
                        out.sampled_logprobs.to(torch.float64)])


def unpack(packed: torch.Tensor) -> SampleOutput:
    return SampleOutput(packed[0].long(), packed[1].float(), packed[2].float())
