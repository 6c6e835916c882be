"""The sampler's logit filters (vocabulary padding, top-k, top-p), shared by generation and the
trainer's truncated log-probs so that both see exactly the same distribution. Full-vocabulary
logits ``[..., V]``; removed entries become -inf."""

from __future__ import annotations

import torch


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Copy of ``logits [B, V_padded]`` with ids ``>= vocab_size`` (embedding padding) set to -inf."""
    if vocab_size > logits.shape[-1]:
        raise ValueError(f"tokenizer vocab_size={vocab_size} exceeds the model's {logits.shape[-1]} logits")
    out = logits.clone()
    out[..., vocab_size:] = float("-inf")
    return out


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits per row (others -inf); ``top_k=0`` keeps all."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (others -inf).

    The most likely token is always kept, so a row never becomes empty.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k, then top-p (what the sampler draws from; others -inf): ``filter_top_p(filter_top_k(...))``
    without sorting the whole vocabulary when both are set — top-p only ranks the top-k survivors
    (ties at the k-th value included), a ``topk`` of a few entries instead of a sort of V."""
    if top_k <= 0 or top_k >= logits.shape[-1] or top_p >= 1.0:
        return filter_top_p(filter_top_k(logits, top_k), top_p)
    kept = filter_top_k(logits, top_k)
    width = int(torch.isfinite(kept).sum(dim=-1).max())  # >= top_k (ties at the boundary stay)
    values, index = torch.topk(kept, width, dim=-1)  # descending; -inf past a row's survivors
    probs = torch.softmax(values, dim=-1)
    drop_sorted = torch.cumsum(probs, dim=-1) - probs >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros(kept.shape, dtype=torch.bool, device=kept.device).scatter(-1, index, drop_sorted)
    return kept.masked_fill(drop, float("-inf"))
