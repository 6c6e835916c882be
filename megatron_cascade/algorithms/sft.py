"""Supervised fine-tuning loss (token-mean negative log-likelihood), used by ``sft`` stages."""

from __future__ import annotations

import torch

from ._common import (
    Normalizer,
    as_bool_mask,
    check_2d,
    check_finite_at,
    check_same_shape,
    compute_dtype,
    f64_sum,
    resolve_normalizer,
)

SFT_METRIC_KEYS = ("tokens", "sequences", "nll_sum")


def sft_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    normalizer: Normalizer = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-sum(mask * logprobs) / normalizer``.

    Args:
        logprobs: ``[B, T]`` log-probs (nats) of the target tokens under the trained policy.
        mask: ``[B, T]`` 1 on tokens that count (the assistant's answer).
        normalizer: global count of valid tokens (default: ``mask.sum()``); constant.
        check_finite: raise on NaN/inf at valid positions.

    Returns:
        ``(loss, metrics)`` with metric sums ``tokens``, ``sequences``, ``nll_sum`` (nats).
    """
    fn = "sft_loss"
    check_2d(fn, "logprobs", logprobs)
    check_same_shape(fn, "mask", mask, "logprobs", logprobs)
    valid = as_bool_mask(fn, mask)
    if check_finite:
        check_finite_at(fn, "logprobs", logprobs, valid)
    dtype = compute_dtype(logprobs.dtype)
    lp = torch.where(valid, logprobs.to(dtype), torch.zeros((), dtype=dtype))
    norm = resolve_normalizer(fn, normalizer, valid.sum(), dtype)
    loss = -lp.sum() / norm
    metrics = {
        "tokens": f64_sum(valid),
        "sequences": f64_sum(valid.any(dim=-1)),
        "nll_sum": -f64_sum(lp.detach()),
    }
    return loss, metrics
