"""Turning summed loss metrics into means.

The losses return metrics as detached float64 scalar tensors that are *sums over valid tokens*
(or counts), so a distributed backend can all-reduce (SUM) every entry across micro-batches and
data-parallel ranks and divide once at the end with :func:`finalize_metrics`. Every loss always
returns the same keys (zeros where a feature is off), so all ranks reduce identical dicts.
"""

from __future__ import annotations

from typing import Mapping, Union

import torch

MetricValue = Union[torch.Tensor, float, int]

#: sum/count key -> (mean key, denominator key).  Keys not listed here pass through unchanged.
METRIC_MEANS: dict[str, tuple[str, str]] = {
    # train/inference mismatch (both losses)
    "is_abs_log_ratio_sum": ("is_abs_log_ratio_mean", "tokens"),  # mean |log pi_train/pi_infer|
    "is_masked_tokens": ("is_masked_frac", "tokens"),  # fraction rejected/clamped by IS bounds
    "is_weight_sum": ("is_weight_mean", "tokens"),  # mean IS weight w
    # GRPO
    "clipped_tokens": ("clip_frac", "tokens"),  # fraction where the clipped branch is active
    "kl_sum": ("kl_mean", "tokens"),  # mean k3 KL to the reference
    "advantage_sum": ("advantage_mean", "tokens"),  # token-mean advantage
    # MOPD
    "reverse_kl_sum": ("reverse_kl_mean", "tokens"),  # mean sampled-token log pi/pi_T
    # SFT
    "nll_sum": ("nll_mean", "tokens"),  # mean negative log-likelihood
    # RL losses on truncated (top-k / top-p) log-probs: tokens outside the trainer's kept set
    "off_support_tokens": ("off_support_frac", "tokens"),
    # every loss (added by the training plug-in)
    "entropy_sum": ("entropy_mean", "tokens"),  # mean entropy of the sampling distribution (nats)
}


def _safe_div(num: MetricValue, den: MetricValue) -> MetricValue:
    if isinstance(den, torch.Tensor):
        return num / den.clamp(min=1)
    return num / max(den, 1)


def finalize_metrics(sums: Mapping[str, MetricValue]) -> dict[str, MetricValue]:
    """Convert (globally reduced) metric sums into means.

    Args:
        sums: dict as returned by :func:`grpo_loss` / :func:`mopd_loss` (possibly summed over
            micro-batches and ranks); values are scalar tensors or Python numbers.

    Returns:
        dict with ``tokens`` and ``sequences`` (counts) kept, every key of :data:`METRIC_MEANS`
        present in ``sums`` replaced by its mean (``is_abs_log_ratio_mean`` [nats],
        ``is_masked_frac``, ``is_weight_mean``, ``clip_frac``, ``kl_mean`` [nats],
        ``advantage_mean``, ``reverse_kl_mean`` [nats]), and any other key passed through.
        A zero denominator (nothing valid) gives mean 0, never NaN.
    """
    out: dict[str, MetricValue] = {}
    for key, value in sums.items():
        if key in METRIC_MEANS:
            mean_key, den_key = METRIC_MEANS[key]
            if den_key not in sums:
                raise KeyError(f"finalize_metrics: `{key}` needs the count `{den_key}` in the dict")
            out[mean_key] = _safe_div(value, sums[den_key])
        else:
            out[key] = value
    return out
