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


def zigzag_positions(segment_lengths: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """[sum(segment_lengths) / CP] int64 positions of a packed row that CP rank ``cp_rank`` holds, in
    the order it holds them: for each segment (lengths multiples of 2 x CP), its chunks ``cp_rank`` and
    ``2 x CP - 1 - cp_rank`` of 2 x CP. Without CP: every position, in order."""
    total = sum(segment_lengths)
    if cp_size == 1:
        return torch.arange(total)
    pieces, start = [], 0
    for length in segment_lengths:
        if length % (2 * cp_size):
            raise ValueError(f"a segment of {length} tokens does not split into 2 x CP = {2 * cp_size} chunks")
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += length
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def cp_row_positions(segment_lengths: list[int], cp_size: int) -> torch.Tensor:
    """[CP, T / CP] the positions every CP rank holds (``zigzag_positions`` of each rank)."""
    return torch.stack([zigzag_positions(segment_lengths, cp_size, r) for r in range(cp_size)])


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
