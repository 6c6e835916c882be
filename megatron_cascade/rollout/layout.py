"""The token buffer of a static generation batch (``static.py``): prompts left-padded so that they
all end at one column.

Why left padding: Megatron's ``StaticInferenceContext`` keeps one write offset
(``sequence_len_offset``) for the whole batch, so every row must take its next token at the same
column. Left padding makes that true for prompts of different lengths. The padding is removed from
the computation by the attention mask (padding keys are never attended to) and, for learned
absolute position embeddings, by per-row position ids that start at 0 on each row's first real
token. RoPE needs no per-row positions: attention scores under RoPE depend only on the distance
between query and key, which left padding does not change (the results agree with an unpadded
forward to float rounding; the tests check 1e-5 on log-probs).

When every prompt of a batch has the same length there is no padding and no mask at all: the
attention builds its own causal mask (the static path batches by prompt length for attention kernels
that cannot take an arbitrary mask, e.g. Transformer Engine's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class PaddedBatch:
    """Rows ``[B, L]`` with ``L = prompt_width + max(budgets)``.

    Attributes:
        tokens: token ids; padding and not-yet-generated columns hold ``pad_id``.
        valid: True where ``tokens`` holds a real (prompt or generated) token.
        position_ids: per-row position of each column (0 at the row's first real token; padding 0).
        prompt_width: column where generation starts (= longest prompt).
        budgets: per row, the most tokens it may generate.
    """

    tokens: torch.Tensor
    valid: torch.Tensor
    position_ids: torch.Tensor
    prompt_width: int
    budgets: list[int]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_length(self) -> int:
        return self.tokens.shape[1]

    def append(self, column: int, tokens: torch.Tensor) -> None:
        """Write the tokens ``[B]`` sampled for ``column`` into the buffer."""
        self.tokens[:, column] = tokens
        self.valid[:, column] = True

    @property
    def padded(self) -> bool:
        """Whether any row has left padding (prompts of different lengths)."""
        return not bool(self.valid[:, : self.prompt_width].all())

    def attention_mask(self, start: int, end: int) -> Optional[torch.Tensor]:
        """Bool ``[B, 1, end - start, end]``, True = masked, for queries at columns ``[start, end)``
        attending to keys ``[0, end)``: causal and never to padding. None without padding.

        Megatron's local core attention takes this mask as-is (it only builds its own causal mask
        when none is given), also in the KV-cached decode steps where it turns its causal mask off.
        """
        if not self.padded:
            return None
        query_cols = torch.arange(start, end, device=self.tokens.device).unsqueeze(1)
        key_cols = torch.arange(end, device=self.tokens.device).unsqueeze(0)
        causal = key_cols <= query_cols  # [q, k]
        allowed = causal.unsqueeze(0) & self.valid[:, :end].unsqueeze(1)  # [B, q, k]
        return ~allowed.unsqueeze(1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, max_new_tokens: int,
             max_sequence_length: int, device: torch.device | str = "cpu") -> PaddedBatch:
    """Left-pad ``prompts`` into a buffer with room for the responses.

    A row's budget is ``min(max_new_tokens, max_sequence_length - len(prompt))``.

    Raises:
        ValueError: an empty prompt, or one that leaves no room under ``max_sequence_length``.
    """
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) == 0:
        raise ValueError("every prompt must have at least one token")
    budgets = [min(max_new_tokens, max_sequence_length - n) for n in lengths]
    if min(budgets) < 1:
        raise ValueError(f"a prompt has {max(lengths)} tokens, leaving no room to generate under "
                         f"max_sequence_length={max_sequence_length}")
    width = max(lengths)
    total = width + max(budgets)
    tokens = torch.full((len(prompts), total), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), total), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):width] = torch.tensor(list(prompt), dtype=torch.long)
        valid[row, width - len(prompt):width] = True
    # Real tokens, prompt and generated, are contiguous from the row's first prompt token on.
    pads = torch.tensor([width - n for n in lengths]).unsqueeze(1)
    positions = (torch.arange(total).unsqueeze(0) - pads).clamp_(min=0)
    return PaddedBatch(tokens.to(device), valid.to(device), positions.to(device), width, budgets)
