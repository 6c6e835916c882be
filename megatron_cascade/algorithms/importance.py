"""Training/inference mismatch correction (importance weights), shared by GRPO and MOPD.

The rollout engine and the trainer compute slightly different probabilities for the same sampled
token (kernels, precision, MoE routing). With ``r_t = pi_train(y_t|s_t) / pi_infer(y_t|s_t)`` the
per-token weight is the stop-gradient of

* ``mode="mask"`` (ICE-POP, default): ``w_t = r_t * 1[low <= r_t <= high]`` (outside: weight 0);
* ``mode="truncate"`` (truncated IS): ``w_t = min(r_t, high)``.

Without inference log-probs the weight is 1 everywhere.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._common import check_bounds

IS_MODES = ("mask", "truncate")


class ImportanceWeights(NamedTuple):
    """Result of :func:`importance_weights`; all tensors ``[B, T]``, detached.

    Attributes:
        weights: ``w_t`` (dimensionless); exactly 0 at masked positions.
        log_ratio: ``log r_t = logprobs - inference_logprobs`` (nats); 0 at masked positions.
        rejected: bool, True at valid tokens whose weight was changed by the bounds
            (zeroed in ``"mask"`` mode, clamped to ``high`` in ``"truncate"`` mode).
    """

    weights: torch.Tensor
    log_ratio: torch.Tensor
    rejected: torch.Tensor


def importance_weights(
    logprobs: torch.Tensor,
    inference_logprobs: Optional[torch.Tensor],
    mask: torch.Tensor,
    *,
    bounds: tuple[float, float] = (0.5, 2.0),
    mode: str = "mask",
) -> ImportanceWeights:
    """Detached train/inference importance weights.

    Args:
        logprobs: ``[B, T]`` trainer log-probs of the sampled tokens (nats).
        inference_logprobs: ``[B, T]`` log-probs the inference engine reported for the same
            tokens (nats), or ``None`` (weights are then 1 at valid positions).
        mask: ``[B, T]`` bool, True at valid (loss) tokens. Values of the log-prob tensors at
            masked positions are ignored, even if NaN/inf.
        bounds: ``(low, high)`` on the probability ratio ``r`` (not its log).
        mode: ``"mask"`` (ICE-POP: weight 0 outside bounds) or ``"truncate"`` (clamp at high).

    Returns:
        :class:`ImportanceWeights` (weights, log_ratio, rejected), each ``[B, T]``, detached.
        The caller is responsible for shape checks (the losses do them).
    """
    if mode not in IS_MODES:
        raise ValueError(f"importance_weights: `mode` must be one of {IS_MODES}, got {mode!r}")
    lo, hi = check_bounds("importance_weights", "bounds", bounds)
    mask = mask.bool()
    lp = logprobs.detach()
    if inference_logprobs is None:
        zeros = torch.zeros_like(lp)
        return ImportanceWeights(mask.to(lp.dtype), zeros, torch.zeros_like(mask))
    log_ratio = torch.where(mask, lp - inference_logprobs.detach().to(lp.dtype), torch.zeros_like(lp))
    r = torch.exp(log_ratio)
    zeros = torch.zeros_like(r)
    if mode == "mask":
        inside = (r >= lo) & (r <= hi)
        weights = torch.where(mask & inside, r, zeros)
        rejected = mask & ~inside
    else:
        weights = torch.where(mask, torch.clamp(r, max=hi), zeros)
        rejected = mask & (r > hi)
    return ImportanceWeights(weights, log_ratio, rejected)
