"""Megatron-Core's KV block allocator with shared blocks: a prompt's G samples hold its full blocks once.

GRPO samples G responses per prompt, and at the recipe's scale the prompt is a large part of each
sample's KV (32K prompt tokens next to 24K expected response tokens at 49K ``max_new_tokens``). A
forked sample (``PagedContext.fork``) points at its prompt's *full* blocks instead of copying them —
no sample writes into a full block again — and gets a private copy of the partly filled last block
only, which both continue to write. A block returns to the pool when its last holder finishes or is
preempted (vLLM's reference-counted prefix blocks, for the one prefix that GRPO always shares).

megatron-core 0.16.1's ``BlockAllocator`` frees every block a released request lists, and counts
the blocks of active requests by summing their block counts (``get_active_used``, which decides how
many requests that need a new block may resume). Both are overridden here; everything else in the
context (block tables, the attention kernels, ``update_requests``) reads the tables as before.
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts.dynamic_block_allocator import BlockAllocator


def full_blocks(tokens: int, block_size_tokens: int) -> int:
    """Blocks a request of ``tokens`` tokens has filled: what its forks share with it."""
    return tokens // block_size_tokens


class SharedBlockAllocator(BlockAllocator):
    """``BlockAllocator`` with a holder count per block (``holders[b]``: requests whose table lists ``b``)."""

    def __init__(self, context, total_count: int, paused_count: int) -> None:
        super().__init__(context, total_count, paused_count)
        self.holders = torch.zeros(total_count, dtype=torch.int32, device=self.block_bag.device)

    def allocate_memory_blocks(self, num_blocks: int):
        blocks = super().allocate_memory_blocks(num_blocks)
        if blocks is not None:
            self.holders[blocks.long()] = 1
        return blocks

    def share(self, blocks: torch.Tensor) -> None:
        """One more request holds ``blocks`` (allocated, full blocks)."""
        self.holders[blocks.long()] += 1

    def release_memory_blocks(self, blocks: torch.Tensor) -> None:
        """Drop one holder per listed block (a block may be listed by several requests released
        together); blocks left without a holder go back to the pool."""
        if blocks.numel() == 0:
            return
        index = blocks.long()
        self.holders.index_add_(0, index, torch.full_like(index, -1, dtype=self.holders.dtype))
        unique = torch.unique(index)
        freed = unique[self.holders[unique] == 0]
        if freed.numel():
            super().release_memory_blocks(freed.to(self.block_bag.dtype))

    def blocks_freed_by(self, blocks: torch.Tensor) -> int:
        """How many blocks would return to the pool if the requests listing ``blocks`` (together)
        were released now."""
        if blocks.numel() == 0:
            return 0
        unique, listed = torch.unique(blocks.long(), return_counts=True)
        return int((self.holders[unique] == listed.to(self.holders.dtype)).sum())

    def get_active_used(self) -> int:
        """Distinct blocks held outside the paused requests (Megatron sums per-request counts, which
        counts a shared block once per holder)."""
        return self.get_total_used() - self.get_paused_used()

    def reset(self) -> None:
        super().reset()
        self.holders.zero_()
