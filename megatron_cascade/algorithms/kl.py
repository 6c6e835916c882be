"""Per-token KL estimators between the policy and a reference, from sampled-token log-probs.

With ``d = ref_logprobs - logprobs`` (nats), for tokens sampled from the policy
(Schulman, "Approximating KL divergence"):

* k1: ``-d`` (unbiased, high variance, can be negative);
* k2: ``d**2 / 2`` (biased, low variance);
* k3: ``exp(d) - d - 1`` (unbiased, >= 0, low variance; the default in GRPO).

All functions are elementwise and differentiable w.r.t. ``logprobs`` (and ``ref_logprobs`` if it
requires grad; pass it detached for a frozen reference).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def k1_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 estimator ``logprobs - ref_logprobs``; inputs any equal shape (nats); returns same shape."""
    return logprobs - ref_logprobs


def k2_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 estimator ``0.5 * (ref_logprobs - logprobs)**2``; elementwise, same shape as inputs."""
    d = ref_logprobs - logprobs
    return 0.5 * d * d


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (>= 0); elementwise, same shape."""
    d = ref_logprobs - logprobs
    return torch.expm1(d) - d


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Dispatch to :func:`k1_kl`, :func:`k2_kl` or :func:`k3_kl` by name (``kind``)."""
    if kind == "k1":
        return k1_kl(logprobs, ref_logprobs)
    if kind == "k2":
        return k2_kl(logprobs, ref_logprobs)
    if kind == "k3":
        return k3_kl(logprobs, ref_logprobs)
    raise ValueError(f"kl_penalty: `kind` must be one of {KL_ESTIMATORS}, got {kind!r}")
