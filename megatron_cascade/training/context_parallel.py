"""Context parallelism: the load-balanced split of packed sequences over the CP ranks, and back.

The split (Megatron-Core's ``get_batch_on_this_cp_rank``, Transformer Engine's THD partitioning):
every sequence, padded to a multiple of 2 x CP, is cut into 2 x CP equal chunks and CP rank r holds
chunks r and 2 x CP - 1 - r. Under causal attention a late chunk attends to more keys than an
early one, so pairing them gives every rank the same attention work. Megatron's THD RoPE
(``_apply_rotary_pos_emb_thd``) and TE's attention assume exactly this order.

The way back: each CP rank computes log-probs of its own positions; the loss needs whole sequences
(per-sequence normalisation, metrics), so the log-probs are all-gathered over the CP group and every
CP rank computes the same loss on the whole batch. Its backward keeps this rank's slice of the
gradient only: the model gradient of rank r is then that of the loss through r's positions, and
Megatron's DDP sums gradients over data x context parallel ranks (``calculate_per_token_loss``: no
averaging), which adds up to the gradient of the loss. The global normaliser is counted before
the split, over the data-parallel group only (every CP rank holds the same batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_cascade.ops.zigzag import cp_row_positions


class _GatherForReplicatedLoss(torch.autograd.Function):
    """All-gather over ``group`` whose backward keeps this rank's slice of the gradient: for a loss
    that every rank of the group computes identically from the gathered values (the gradients of
    the group's ranks are summed afterwards, by DDP)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank], None


def gather_row_from_cp(local: torch.Tensor, row_length: int, group, segment_lengths: list[int] | None = None,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
    """[row_length] values of a whole packed row from each CP rank's [row_length / CP] ``local``
    values (differentiable: see the module docstring). ``positions``: [CP, T / CP] from
    ``cp_row_positions`` (built from ``segment_lengths`` when not given)."""
    gathered = _GatherForReplicatedLoss.apply(local, group)  # [CP, T / CP]
    if positions is None:
        if segment_lengths is None:
            raise ValueError("gather_row_from_cp needs segment_lengths or positions")
        positions = cp_row_positions(segment_lengths, gathered.shape[0])
    positions = positions.to(local.device).reshape(-1)
    row = torch.zeros(row_length, dtype=local.dtype, device=local.device)
    return row.index_put((positions,), gathered.reshape(-1))
