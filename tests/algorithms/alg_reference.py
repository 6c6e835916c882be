"""Plain float64 single-process references, written token by token with Python scalars.

Deliberately independent of the implementation: explicit loops, ``math.exp``, and the
gradient w.r.t. each log-prob derived by hand (no autograd).
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def _lists(*xs: Optional[torch.Tensor]):
    return [None if x is None else x.detach().double().tolist() for x in xs]


def _is_weight(x: float, inf: Optional[float], bounds, mode):
    """Return (w, log_ratio, rejected) for one valid token."""
    if inf is None:
        return 1.0, 0.0, False
    log_r = x - inf
    r = math.exp(log_r)
    lo, hi = bounds
    if mode == "mask":
        if lo <= r <= hi:
            return r, log_r, False
        return 0.0, log_r, True
    return (min(r, hi), log_r, r > hi)


def ref_grpo(
    logprobs, advantages, mask, *, old=None, inference=None, ref=None, clip_eps=(0.2, 0.2),
    is_bounds=(0.5, 2.0), is_mode="mask", kl_coef=0.0, normalizer=None,
):
    """Returns (loss, grad [B][T] w.r.t. logprobs, metric sums dict)."""
    lp, adv, mk, old_, inf_, ref_ = _lists(logprobs, advantages, mask, old, inference, ref)
    B, T = len(lp), len(lp[0])
    count = 0
    for b in range(B):
        for t in range(T):
            if mk[b][t]:
                count += 1
    N = count if normalizer is None else float(normalizer)
    if N == 0:
        N = 1.0
    lo_b, hi_b = 1.0 - clip_eps[0], 1.0 + clip_eps[1]
    num = 0.0
    grad = [[0.0] * T for _ in range(B)]
    m = dict(tokens=0.0, sequences=0.0, advantage_sum=0.0, is_abs_log_ratio_sum=0.0,
             is_masked_tokens=0.0, is_weight_sum=0.0, clipped_tokens=0.0, kl_sum=0.0)
    for b in range(B):
        row_has = False
        for t in range(T):
            if not mk[b][t]:
                continue
            row_has = True
            x = lp[b][t]
            A = adv[b] if not isinstance(adv[b], list) else adv[b][t]
            o = x if old_ is None else old_[b][t]
            rho = math.exp(x - o)
            unclipped = rho * A
            rho_c = min(max(rho, lo_b), hi_b)
            clipped = rho_c * A
            if unclipped <= clipped:
                term, dterm = unclipped, rho * A
            else:
                term = clipped
                dterm = rho * A if lo_b < rho < hi_b else 0.0
            w, log_r, rej = _is_weight(o, None if inf_ is None else inf_[b][t], is_bounds, is_mode)
            contrib, g = w * term, w * dterm
            if ref_ is not None:
                # verl / NeMo-RL k3: log-ratio clamped to [-20, 20], the estimate to <= 10;
                # no gradient through an active clamp.
                raw = ref_[b][t] - x
                d = min(max(raw, -20.0), 20.0)
                kl = math.exp(d) - d - 1.0
                live = abs(raw) <= 20.0 and kl <= 10.0
                kl = min(kl, 10.0)
                m["kl_sum"] += kl
                contrib -= kl_coef * kl
                if live:
                    g -= kl_coef * (1.0 - math.exp(d))
            num += contrib
            grad[b][t] = -g / N
            m["tokens"] += 1
            m["advantage_sum"] += A
            m["is_abs_log_ratio_sum"] += abs(log_r)
            m["is_masked_tokens"] += float(rej)
            m["is_weight_sum"] += w
            if (A > 0 and rho > hi_b) or (A < 0 and rho < lo_b):
                m["clipped_tokens"] += 1
        m["sequences"] += float(row_has)
    return -num / N, grad, m


def ref_mopd(
    logprobs, teacher, mask, *, inference=None, is_bounds=(0.5, 2.0), is_mode="mask",
    normalization="sequence", normalizer=None,
):
    """Returns (loss, grad [B][T] w.r.t. logprobs, metric sums dict)."""
    lp, te, mk, inf_ = _lists(logprobs, teacher, mask, inference)
    B, T = len(lp), len(lp[0])
    seq_len = [sum(1 for t in range(T) if mk[b][t]) for b in range(B)]
    if normalizer is not None:
        N = float(normalizer)
    elif normalization == "sequence":
        N = float(sum(1 for n in seq_len if n > 0))
    else:
        N = float(sum(seq_len))
    if N == 0:
        N = 1.0
    num = 0.0
    grad = [[0.0] * T for _ in range(B)]
    m = dict(tokens=0.0, sequences=0.0, reverse_kl_sum=0.0, is_abs_log_ratio_sum=0.0,
             is_masked_tokens=0.0, is_weight_sum=0.0)
    for b in range(B):
        if seq_len[b] == 0:
            continue
        m["sequences"] += 1
        scale = 1.0 / seq_len[b] if normalization == "sequence" else 1.0
        for t in range(T):
            if not mk[b][t]:
                continue
            x = lp[b][t]
            a = te[b][t] - x
            w, log_r, rej = _is_weight(x, None if inf_ is None else inf_[b][t], is_bounds, is_mode)
            num += scale * w * a * x
            grad[b][t] = -scale * w * a / N
            m["tokens"] += 1
            m["reverse_kl_sum"] += x - te[b][t]
            m["is_abs_log_ratio_sum"] += abs(log_r)
            m["is_masked_tokens"] += float(rej)
            m["is_weight_sum"] += w
    return -num / N, grad, m


def ref_group_advantages(rewards, *, std_normalize=True, eps=1e-6, baseline="mean", valid=None, std_kind="sample"):
    """Mean baseline: the group's std. Leave-one-out: NeMo-RL's RLOO, baseline and std of the *other*
    valid responses, no division where that std is 0."""
    rw = rewards.double().tolist()
    vd = None if valid is None else valid.tolist()
    out = []
    for p, row in enumerate(rw):
        idx = [g for g in range(len(row)) if vd is None or vd[p][g]]
        vals = [row[g] for g in idx]
        res = [0.0] * len(row)
        if len(vals) >= 2 and max(vals) != min(vals):
            for g in idx:
                pool = vals if baseline == "mean" else [row[h] for h in idx if h != g]
                base = sum(pool) / len(pool)
                dof = len(pool) - 1 if std_kind == "sample" else len(pool)
                sd = math.sqrt(sum((x - base) ** 2 for x in pool) / dof) if dof > 0 else 0.0
                a = row[g] - base
                if std_normalize and (baseline == "mean" or sd > 0):
                    a = a / (sd + eps)
                res[g] = a
        out.append(res)
    return out


def make_batch(seed: int, B: int = 7, T: int = 9, poison: bool = True) -> dict[str, torch.Tensor]:
    """Random float64 batch with ragged masks, one fully masked row, rho outside the clip range,
    r outside the IS bounds, and NaN/inf garbage at masked positions (if ``poison``)."""
    g = torch.Generator().manual_seed(seed)
    f = dict(dtype=torch.float64, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = True
    mask[2] = False
    mask[3, 0] = True  # a row with at least one valid token
    lp = -3.0 * torch.rand(B, T, **f) - 0.01
    batch = dict(
        mask=mask,
        logprobs=lp,
        old=lp + 0.4 * torch.randn(B, T, **f),
        inference=lp + 0.6 * torch.randn(B, T, **f),
        ref=lp + 0.5 * torch.randn(B, T, **f),
        teacher=lp + torch.randn(B, T, **f),
        adv_seq=torch.randn(B, **f),
        adv_tok=torch.randn(B, T, **f),
    )
    if poison:
        garbage = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)
        for k in ("logprobs", "old", "inference", "ref", "teacher", "adv_tok"):
            x = batch[k].clone()
            n_masked = int((~mask).sum())
            x[~mask] = garbage[torch.arange(n_masked) % 3]
            batch[k] = x
    return batch
