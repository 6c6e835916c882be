"""MOPD: multi-domain on-policy distillation loss (sampled-token reverse-KL advantage).

The student samples ``y ~ pi_infer``; a per-domain teacher scores the same tokens. Per token
``a_t = sg(log pi_T(y_t|s_t) - log pi_train(y_t|s_t))`` and the loss is a policy gradient with
that advantage, weighted by the train/inference IS weights. Pure tensor function: the backend
passes the global sequence (or token) count as ``normalizer``.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_cascade.config.training import MopdNormalization

from ._common import (
    Normalizer,
    as_bool_mask,
    check_2d,
    check_bounds,
    check_finite_at,
    check_same_shape,
    compute_dtype,
    f64_sum,
    optional_check,
    resolve_normalizer,
)
from .importance import IS_MODES, importance_weights

MOPD_NORMALIZATIONS = tuple(MopdNormalization.values())  # loss.mopd_normalization's choices

#: Keys of the metrics dict returned by :func:`mopd_loss` (always all present).
MOPD_METRIC_KEYS = (
    "tokens",
    "sequences",
    "reverse_kl_sum",
    "is_abs_log_ratio_sum",
    "is_masked_tokens",
    "is_weight_sum",
)


def mopd_loss(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    inference_logprobs: Optional[torch.Tensor] = None,
    is_bounds: tuple[float, float] = (0.5, 2.0),
    is_mode: str = "mask",
    normalization: str = "sequence",
    normalizer: Normalizer = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MOPD loss.

    With ``a = sg(teacher_logprobs - logprobs)``, ``w`` the detached IS weights and
    ``c = mask * w * a * logprobs``:

    * ``normalization="sequence"`` (paper default):
      ``loss = -(1/N) * sum_{b: |V_b| > 0} (sum_t c[b, t]) / |V_b|``, ``|V_b| = sum_t mask[b, t]``,
      ``N`` defaulting to the number of sequences with at least one valid token;
    * ``normalization="token"``: ``loss = -(1/N) * sum_{b,t} c[b, t]``, ``N`` defaulting to
      ``mask.sum()``.

    The gradient w.r.t. ``logprobs[b, t]`` is ``-w * a / (|V_b| * N)`` (resp. ``-w * a / N``).

    Args:
        logprobs: ``[B, T]`` student (trainer) log-probs of the sampled tokens (nats).
        teacher_logprobs: ``[B, T]`` teacher log-probs of the same tokens (nats); constant.
        mask: ``[B, T]`` bool or 0/1, True at response tokens in the loss. Values of every input
            at masked positions are ignored (may be NaN/inf) and get zero gradient.
        inference_logprobs: ``[B, T]`` inference-engine log-probs (nats), or ``None`` (w = 1).
        is_bounds: ``(low, high)`` bounds on ``r = pi_train / pi_infer``.
        is_mode: ``"mask"`` (ICE-POP, weight 0 outside bounds) or ``"truncate"`` (clamp at high).
        normalization: ``"sequence"`` or ``"token"``.
        normalizer: ``N`` (global sequence count resp. global token count from the backend);
            0 is replaced by 1 (an all-masked batch gives loss 0, not NaN). Constant.
        check_finite: raise :class:`NonFiniteInputError` (a ValueError) on NaN/inf at valid
            positions of any log-prob input (one host sync).

    Returns:
        ``(loss, metrics)``: ``loss`` 0-dim tensor (dtype of ``logprobs`` promoted to >= float32);
        ``metrics`` detached float64 0-dim SUMS: ``tokens``, ``sequences`` (rows with >= 1 valid
        token), ``reverse_kl_sum`` (sum of ``logprobs - teacher_logprobs`` over valid tokens,
        nats: the sampled-token reverse KL estimate), ``is_abs_log_ratio_sum`` (nats),
        ``is_masked_tokens``, ``is_weight_sum``. Use
        :func:`~megatron_cascade.algorithms.finalize_metrics` after all-reducing.

    Raises:
        ValueError: on shape mismatches (naming argument and both shapes), bad options,
            non-0/1 masks, or non-finite inputs at valid positions.
    """
    fn = "mopd_loss"
    check_2d(fn, "logprobs", logprobs)
    check_same_shape(fn, "teacher_logprobs", teacher_logprobs, "logprobs", logprobs)
    check_same_shape(fn, "mask", mask, "logprobs", logprobs)
    optional_check(fn, "inference_logprobs", inference_logprobs, logprobs)
    check_bounds(fn, "is_bounds", is_bounds)
    if is_mode not in IS_MODES:
        raise ValueError(f"{fn}: `is_mode` must be one of {IS_MODES}, got {is_mode!r}")
    if normalization not in MOPD_NORMALIZATIONS:
        raise ValueError(
            f"{fn}: `normalization` must be one of {MOPD_NORMALIZATIONS}, got {normalization!r}"
        )

    m = as_bool_mask(fn, mask)
    if check_finite:
        check_finite_at(fn, "logprobs", logprobs, m)
        check_finite_at(fn, "teacher_logprobs", teacher_logprobs, m)
        if inference_logprobs is not None:
            check_finite_at(fn, "inference_logprobs", inference_logprobs, m)

    dt = compute_dtype(logprobs.dtype)
    zeros = torch.zeros(logprobs.shape, dtype=dt, device=logprobs.device)
    logp = torch.where(m, logprobs.to(dt), zeros)
    teacher = torch.where(m, teacher_logprobs.detach().to(dt), zeros)
    adv = (teacher - logp).detach()

    inf_lp = None if inference_logprobs is None else inference_logprobs.to(dt)
    isw = importance_weights(logp, inf_lp, m, bounds=is_bounds, mode=is_mode)
    contrib = isw.weights * adv * logp  # exactly 0 at masked positions

    seq_tokens = m.sum(dim=1)
    if normalization == "sequence":
        per_seq = contrib.sum(dim=1) / seq_tokens.clamp(min=1).to(dt)
        numerator = per_seq.sum()  # rows without valid tokens contribute exactly 0
        n = resolve_normalizer(fn, normalizer, (seq_tokens > 0).sum(), dt)
    else:
        numerator = contrib.sum()
        n = resolve_normalizer(fn, normalizer, seq_tokens.sum(), dt)
    loss = -numerator / n

    with torch.no_grad():
        metrics = {
            "tokens": f64_sum(m),
            "sequences": f64_sum(seq_tokens > 0),
            "reverse_kl_sum": f64_sum(-adv),
            "is_abs_log_ratio_sum": f64_sum(isw.log_ratio.abs()),
            "is_masked_tokens": f64_sum(isw.rejected),
            "is_weight_sum": f64_sum(isw.weights),
        }
    return loss, metrics
