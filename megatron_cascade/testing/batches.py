"""Random RL training batches for layout-comparison tests (yours too): every field a loss reads."""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_cascade.training.batch import TrainBatch

# (first loss position, loss tokens) per row: rows of very different lengths, some of one token.
UNEVEN_SPANS = ((3, 1), (3, 20), (3, 3), (3, 12), (3, 7), (3, 2), (3, 16), (3, 5))


def random_rl_batch(spans: Sequence[tuple[int, int]], seq_length: int, vocab_size: int, seed: int = 3) -> TrainBatch:
    """A [len(spans), seq_length] batch of random tokens whose loss mask covers ``spans`` (one
    ``(start, length)`` per row), with random [B] advantages and inference / teacher / reference
    log-probs in [-6, 0] nats — the same tensors for the same arguments."""
    rows = len(spans)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (rows, seq_length + 1), generator=gen)
    mask = torch.zeros(rows, seq_length)
    for row, (start, length) in enumerate(spans):
        mask[row, start:start + length] = 1
    return TrainBatch(
        input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask,
        advantages=torch.randn(rows, generator=gen),
        inference_logprobs=-torch.rand(rows, seq_length, generator=gen) * 6,
        teacher_logprobs=-torch.rand(rows, seq_length, generator=gen) * 6,
        ref_logprobs=-torch.rand(rows, seq_length, generator=gen) * 6,
    )
