"""The load-balanced split of packed sequences over context-parallel ranks, as positions (pure index
math; ``training/context_parallel.py`` moves the tensors).

Every sequence, padded to a multiple of 2 x CP, is cut into 2 x CP equal chunks and CP rank r holds
chunks r and 2 x CP - 1 - r: under causal attention a late chunk attends to more keys than an early
one, so pairing them gives every rank the same attention work (Megatron-Core's
``get_batch_on_this_cp_rank``, Transformer Engine's THD partitioning).
"""

from __future__ import annotations

import torch


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
