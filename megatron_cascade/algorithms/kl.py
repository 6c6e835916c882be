"""Per-token KL estimators between the policy and a reference, from sampled-token log-probs.

With ``d = ref_logprobs - logprobs`` (nats), for tokens sampled from the policy
(Schulman, "Approximating KL divergence"):

* k1: ``-d`` (unbiased, high variance, can be negative);
* k2: ``d**2 / 2`` (biased, low variance);
* k3: ``exp(d) - d - 1`` (unbiased, >= 0, low variance; the default in GRPO), computed as verl and
  NeMo-RL do: ``d`` clamped to [-20, 20] before the exponential and the estimate to at most 10, so
  one token far from the reference (e.g. RLHF at KL 0.03) cannot dominate the loss or its gradient
  (zero gradient where a clamp is active).

All functions are elementwise and differentiable w.r.t. ``logprobs`` (and ``ref_logprobs`` if it
requires grad; pass it detached for a frozen reference).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
# The clamps of verl's ``low_var_kl`` and NeMo-RL's ``calculate_kl`` (input 20, output 10).
K3_LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def k1_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 estimator ``logprobs - ref_logprobs``; inputs any equal shape (nats); returns same shape."""
    return logprobs - ref_logprobs


def k2_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 estimator ``0.5 * (ref_logprobs - logprobs)**2``; elementwise, same shape as inputs."""
    d = ref_logprobs - logprobs
    return 0.5 * d * d


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator ``min(exp(d) - d - 1, 10)`` with ``d = clamp(ref - logp, -20, 20)`` (>= 0, nats);
    elementwise, same shape."""
    d = torch.clamp(ref_logprobs - logprobs, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.expm1(d) - d, max=K3_CLAMP)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Dispatch to :func:`k1_kl`, :func:`k2_kl` or :func:`k3_kl` by name (``kind``)."""
    if kind == "k1":
        return k1_kl(logprobs, ref_logprobs)
    if kind == "k2":
        return k2_kl(logprobs, ref_logprobs)
    if kind == "k3":
        return k3_kl(logprobs, ref_logprobs)
    raise ValueError(f"kl_penalty: `kind` must be one of {KL_ESTIMATORS}, got {kind!r}")
