"""GRPO policy-gradient loss (clipped surrogate, train/inference IS correction, optional k3 KL).

Pure tensor function: the distributed backend passes the *global* number of valid tokens as
``normalizer`` so that the gradient does not depend on how the batch is split into micro-batches
and data-parallel ranks (summing per-shard losses equals the full-batch loss).
"""

from __future__ import annotations

from typing import Optional

import torch

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
from .kl import k3_kl

#: Keys of the metrics dict returned by :func:`grpo_loss` (always all present).
GRPO_METRIC_KEYS = (
    "tokens",
    "sequences",
    "advantage_sum",
    "is_abs_log_ratio_sum",
    "is_masked_tokens",
    "is_weight_sum",
    "clipped_tokens",
    "kl_sum",
)


def _check_advantages(fn: str, advantages: torch.Tensor, logprobs: torch.Tensor) -> None:
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"{fn}: `advantages` must be a torch.Tensor, got {type(advantages).__name__}")
    ok = advantages.shape == logprobs.shape or (
        advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]
    )
    if not ok:
        raise ValueError(
            f"{fn}: `advantages` has shape {tuple(advantages.shape)} but `logprobs` has shape "
            f"{tuple(logprobs.shape)}; advantages must be [batch] ({logprobs.shape[0]},) or "
            f"[batch, tokens] {tuple(logprobs.shape)}"
        )


def _checked_grpo_inputs(logprobs, mask, advantages, old_logprobs, inference_logprobs, ref_logprobs, clip_eps,
                         is_bounds, is_mode, kl_coef, check_finite) -> tuple[torch.Tensor, tuple[float, float]]:
    """``grpo_loss``'s argument checks (``ValueError`` naming the argument); returns the boolean mask
    and the clip range."""
    fn = "grpo_loss"
    check_2d(fn, "logprobs", logprobs)
    check_same_shape(fn, "mask", mask, "logprobs", logprobs)
    _check_advantages(fn, advantages, logprobs)
    optional_check(fn, "old_logprobs", old_logprobs, logprobs)
    optional_check(fn, "inference_logprobs", inference_logprobs, logprobs)
    optional_check(fn, "ref_logprobs", ref_logprobs, logprobs)
    clip = _clip_eps(fn, clip_eps)
    check_bounds(fn, "is_bounds", is_bounds)
    if is_mode not in IS_MODES:
        raise ValueError(f"{fn}: `is_mode` must be one of {IS_MODES}, got {is_mode!r}")
    if kl_coef < 0:
        raise ValueError(f"{fn}: `kl_coef` must be >= 0, got {kl_coef}")
    if kl_coef != 0 and ref_logprobs is None:
        raise ValueError(f"{fn}: `kl_coef` is {kl_coef} but no `ref_logprobs` were given")
    m = as_bool_mask(fn, mask)
    if check_finite:
        check_finite_at(fn, "logprobs", logprobs, m)
        check_finite_at(fn, "advantages", advantages, m.any(dim=1) if advantages.dim() == 1 else m)
        for name, x in (("old_logprobs", old_logprobs), ("inference_logprobs", inference_logprobs),
                        ("ref_logprobs", ref_logprobs)):
            if x is not None:
                check_finite_at(fn, name, x, m)
    return m, clip


def grpo_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logprobs: Optional[torch.Tensor] = None,
    inference_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    clip_eps: tuple[float, float] = (0.2, 0.2),
    is_bounds: tuple[float, float] = (0.5, 2.0),
    is_mode: str = "mask",
    kl_coef: float = 0.0,
    normalizer: Normalizer = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO / PPO-clip loss with ICE-POP train/inference mismatch weights.

    ``loss = -(1/N) * sum_{b,t} mask * (w * min(rho*A, clip(rho, 1-eps_lo, 1+eps_hi)*A) - kl_coef * kl)``
    with ``rho = exp(logprobs - old_logprobs)``, ``w`` from
    :func:`~megatron_cascade.algorithms.importance.importance_weights` (detached) and
    ``kl`` the k3 estimate of :func:`~megatron_cascade.algorithms.kl.k3_kl` (clamped as verl / NeMo-RL).
    ``w`` is computed from ``old_logprobs`` (the sampling policy) when given, else from ``logprobs``.

    Args:
        logprobs: ``[B, T]`` trainer log-probs of the sampled tokens (nats); differentiable.
        advantages: ``[B]`` (one per response, broadcast over tokens) or ``[B, T]``; treated as
            constants.
        mask: ``[B, T]`` bool or 0/1, True at response tokens that enter the loss. Every input's
            values at masked positions are ignored (may be NaN/inf) and get zero gradient.
        old_logprobs: ``[B, T]`` log-probs of the policy that produced the batch (nats), or
            ``None`` for strictly on-policy training: ``rho`` is then computed against
            ``logprobs.detach()`` (value 1, gradient of REINFORCE).
        inference_logprobs: ``[B, T]`` inference-engine log-probs (nats) for the IS correction,
            or ``None`` (weight 1).
        ref_logprobs: ``[B, T]`` reference-policy log-probs (nats) for the KL term / KL metric.
            Required when ``kl_coef != 0``.
        clip_eps: ``(eps_lo, eps_hi)``; ``rho`` is clipped to ``[1 - eps_lo, 1 + eps_hi]``.
        is_bounds: ``(low, high)`` bounds on ``r = pi_train / pi_infer``.
        is_mode: ``"mask"`` (weight ``r`` inside bounds, 0 outside) or ``"truncate"``
            (weight ``min(r, high)``).
        kl_coef: coefficient ``beta >= 0`` of the k3 KL penalty.
        normalizer: ``N``; default: number of valid tokens in this call (``mask.sum()``). The
            distributed backend passes the global valid-token count. 0 is replaced by 1 (an
            all-masked batch gives loss 0, not NaN). Treated as a constant (no gradient).
        check_finite: raise :class:`NonFiniteInputError` (a ValueError) if a log-prob or
            advantage is NaN/inf at a valid position (one host sync).

    Returns:
        ``(loss, metrics)``: ``loss`` a 0-dim tensor in ``logprobs``' dtype promoted to at least
        float32; ``metrics`` a dict of detached float64 0-dim tensors holding SUMS over valid
        tokens (all-reduce with SUM, then :func:`~megatron_cascade.algorithms.finalize_metrics`):
        ``tokens`` (valid tokens), ``sequences`` (rows with >= 1 valid token),
        ``advantage_sum``, ``is_abs_log_ratio_sum`` (sum |log r|, nats),
        ``is_masked_tokens`` (tokens zeroed / clamped by ``is_bounds``), ``is_weight_sum``,
        ``clipped_tokens`` (tokens whose clipped branch is active, i.e. zero gradient),
        ``kl_sum`` (k3 KL sum, nats; 0 without ``ref_logprobs``).

    Raises:
        ValueError: on shape mismatches (naming the argument and both shapes), bad options,
            non-0/1 masks, ``kl_coef != 0`` without ``ref_logprobs``, or non-finite inputs.
    """
    m, (eps_lo, eps_hi) = _checked_grpo_inputs(logprobs, mask, advantages, old_logprobs, inference_logprobs,
                                               ref_logprobs, clip_eps, is_bounds, is_mode, kl_coef, check_finite)
    dt = compute_dtype(logprobs.dtype)
    zeros = torch.zeros(logprobs.shape, dtype=dt, device=logprobs.device)
    logp = torch.where(m, logprobs.to(dt), zeros)
    adv = advantages.detach().to(dt)
    if adv.dim() == 1:
        adv = adv[:, None].expand(logp.shape)
    adv = torch.where(m, adv, zeros)
    if old_logprobs is None:
        old = logp.detach()
    else:
        old = torch.where(m, old_logprobs.detach().to(dt), zeros)

    rho = torch.exp(logp - old)
    unclipped = rho * adv
    clipped = torch.clamp(rho, 1.0 - eps_lo, 1.0 + eps_hi) * adv
    term = torch.minimum(unclipped, clipped)

    inf_lp = None if inference_logprobs is None else inference_logprobs.to(dt)
    # The train/inference mismatch is that of the policy that sampled (pi_old / pi_infer), as in verl
    # and NeMo-RL: with ppo_epochs > 1, pi_theta / pi_infer would also count the policy's own
    # updates and ICE-POP would reject tokens because training moved them.
    isw = importance_weights(old, inf_lp, m, bounds=is_bounds, mode=is_mode)
    numerator = (isw.weights * term).sum()

    if ref_logprobs is not None:
        ref = torch.where(m, ref_logprobs.detach().to(dt), zeros)
        kl = torch.where(m, k3_kl(logp, ref), zeros)
        if kl_coef != 0:
            numerator = numerator - kl_coef * kl.sum()
        kl_sum = f64_sum(kl)
    else:
        kl_sum = torch.zeros((), dtype=torch.float64, device=logprobs.device)

    n = resolve_normalizer("grpo_loss", normalizer, m.sum(), dt)
    loss = -numerator / n

    with torch.no_grad():
        rho_d = rho.detach()
        clip_active = m & (((adv > 0) & (rho_d > 1.0 + eps_hi)) | ((adv < 0) & (rho_d < 1.0 - eps_lo)))
        metrics = {
            "tokens": f64_sum(m),
            "sequences": f64_sum(m.any(dim=1)),
            "advantage_sum": f64_sum(adv),
            "is_abs_log_ratio_sum": f64_sum(isw.log_ratio.abs()),
            "is_masked_tokens": f64_sum(isw.rejected),
            "is_weight_sum": f64_sum(isw.weights),
            "clipped_tokens": f64_sum(clip_active),
            "kl_sum": kl_sum,
        }
    return loss, metrics


def _clip_eps(fn: str, clip_eps: tuple[float, float]) -> tuple[float, float]:
    try:
        lo, hi = (float(e) for e in clip_eps)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: `clip_eps` must be a pair (eps_lo, eps_hi), got {clip_eps!r}") from None
    if not (0.0 <= lo <= 1.0 and hi >= 0.0):
        raise ValueError(f"{fn}: `clip_eps` must satisfy 0 <= eps_lo <= 1 and eps_hi >= 0, got {clip_eps!r}")
    return lo, hi
