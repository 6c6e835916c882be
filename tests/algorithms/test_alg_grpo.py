"""grpo_loss against the float64 token-loop reference, split invariance, masking and errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from alg_reference import make_batch, ref_grpo
from megatron_cascade.algorithms import (
    GRPO_METRIC_KEYS,
    NonFiniteInputError,
    finalize_metrics,
    grpo_loss,
)

TOL = 1e-10


def _run(b, *, adv="seq", use_old=True, use_inf=True, use_ref=False, lp=None, **kw):
    lp = b["logprobs"].clone().requires_grad_(True) if lp is None else lp
    loss, metrics = grpo_loss(
        lp,
        b["adv_seq"] if adv == "seq" else b["adv_tok"],
        b["mask"],
        old_logprobs=b["old"] if use_old else None,
        inference_logprobs=b["inference"] if use_inf else None,
        ref_logprobs=b["ref"] if use_ref else None,
        **kw,
    )
    return lp, loss, metrics


def _ref(b, *, adv="seq", use_old=True, use_inf=True, use_ref=False, **kw):
    return ref_grpo(
        b["logprobs"],
        b["adv_seq"] if adv == "seq" else b["adv_tok"],
        b["mask"],
        old=b["old"] if use_old else None,
        inference=b["inference"] if use_inf else None,
        ref=b["ref"] if use_ref else None,
        **kw,
    )


CASES = list(
    itertools.product(
        ["seq", "tok"],  # advantages [B] / [B, T]
        [False, True],  # old_logprobs
        [False, True],  # inference_logprobs
        ["mask", "truncate"],
        [0.0, 0.1],  # kl_coef (with ref_logprobs)
    )
)


@pytest.mark.parametrize("adv,use_old,use_inf,is_mode,kl_coef", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference(seed, adv, use_old, use_inf, is_mode, kl_coef):
    b = make_batch(seed)
    kw = dict(adv=adv, use_old=use_old, use_inf=use_inf, use_ref=kl_coef > 0, is_mode=is_mode,
              kl_coef=kl_coef, clip_eps=(0.2, 0.28), is_bounds=(0.5, 2.0))
    lp, loss, metrics = _run(b, **kw)
    loss.backward()
    ref_loss, ref_grad, ref_metrics = _ref(b, **kw)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - ref_loss) < TOL
    assert torch.isfinite(lp.grad).all()
    assert torch.allclose(lp.grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=0, atol=TOL)
    assert set(metrics) == set(GRPO_METRIC_KEYS)
    for k, v in metrics.items():
        assert v.dtype == torch.float64 and v.dim() == 0 and not v.requires_grad
        assert abs(v.item() - ref_metrics[k]) < 1e-9, k
    # the random data really exercises clipping and IS rejection
    if use_old:
        assert ref_metrics["clipped_tokens"] > 0
    if use_inf:
        assert ref_metrics["is_masked_tokens"] > 0


def test_explicit_normalizer_and_kl_metric_without_coef():
    b = make_batch(3)
    lp, loss, metrics = _run(b, use_ref=True, kl_coef=0.0, normalizer=123.0)
    loss.backward()
    ref_loss, ref_grad, ref_metrics = _ref(b, use_ref=True, kl_coef=0.0, normalizer=123.0)
    assert abs(loss.item() - ref_loss) < TOL
    assert torch.allclose(lp.grad, torch.tensor(ref_grad, dtype=torch.float64), atol=TOL, rtol=0)
    assert ref_metrics["kl_sum"] > 0 and abs(metrics["kl_sum"].item() - ref_metrics["kl_sum"]) < 1e-9
    # tensor normalizer gives the same result and no gradient flows into it
    n = torch.tensor(123.0, dtype=torch.float64, requires_grad=True)
    _, loss2, _ = _run(b, use_ref=True, normalizer=n)
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-14)


def test_on_policy_is_reinforce():
    """old_logprobs=None: rho == 1 and the gradient is -w*A/N (REINFORCE)."""
    b = make_batch(4, poison=False)
    lp, loss, metrics = _run(b, use_old=False, use_inf=False)
    loss.backward()
    m = b["mask"].double()
    expected = -(b["adv_seq"][:, None] * m) / m.sum()
    assert torch.allclose(lp.grad, expected, atol=TOL, rtol=0)
    assert metrics["clipped_tokens"].item() == 0


@pytest.mark.parametrize("split", [1, 3, 4, 6])
@pytest.mark.parametrize("adv", ["seq", "tok"])
def test_split_invariance(split, adv):
    b = make_batch(5)
    kw = dict(adv=adv, use_ref=True, kl_coef=0.05)
    lp_full, loss_full, m_full = _run(b, **kw)
    loss_full.backward()
    n_global = b["mask"].sum()
    lp = b["logprobs"].clone().requires_grad_(True)
    total, sums = 0.0, {k: 0.0 for k in m_full}
    for rows in (slice(0, split), slice(split, None)):
        part = {k: v[rows] for k, v in b.items()}
        _, loss, m = _run(part, lp=lp[rows], normalizer=n_global, **kw)
        total = total + loss
        sums = {k: sums[k] + m[k] for k in sums}
    total.backward()
    assert abs(total.item() - loss_full.item()) < TOL
    assert torch.allclose(lp.grad, lp_full.grad, atol=TOL, rtol=0)
    for k in m_full:
        assert abs(sums[k].item() - m_full[k].item()) < 1e-9, k


@pytest.mark.parametrize("normalizer", [None, 0, torch.tensor(0.0)])
def test_all_masked_batch(normalizer):
    b = make_batch(6)
    b["mask"] = torch.zeros_like(b["mask"])
    b["logprobs"] = torch.full_like(b["logprobs"], float("nan"))
    lp, loss, metrics = _run(b, use_ref=True, kl_coef=0.1, normalizer=normalizer)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros_like(lp.grad))
    assert all(v.item() == 0 for v in metrics.values())
    means = finalize_metrics(metrics)
    assert all(torch.isfinite(v) and v.item() == 0 for v in means.values())


def test_nan_at_masked_positions_has_no_effect():
    poisoned = make_batch(7, poison=True)
    clean = make_batch(7, poison=False)
    assert torch.isnan(poisoned["logprobs"]).any()
    kw = dict(adv="tok", use_ref=True, kl_coef=0.1)
    lp_p, loss_p, m_p = _run(poisoned, **kw)
    lp_c, loss_c, m_c = _run(clean, **kw)
    loss_p.backward()
    loss_c.backward()
    assert loss_p.item() == loss_c.item()
    assert torch.equal(lp_p.grad, lp_c.grad)
    assert (lp_p.grad[~poisoned["mask"]] == 0).all()
    assert all(m_p[k].item() == m_c[k].item() for k in m_p)


@pytest.mark.parametrize("key,arg", [("logprobs", "logprobs"), ("old", "old_logprobs"),
                                     ("inference", "inference_logprobs"), ("ref", "ref_logprobs"),
                                     ("adv_tok", "advantages")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_at_valid_position_raises(key, arg, bad):
    b = make_batch(8)
    x = b[key].clone()
    x[1, 3] = bad
    b["mask"][1, 3] = True
    b[key] = x
    with pytest.raises(NonFiniteInputError, match=rf"`{arg}`.*batch=1, token=3"):
        _run(b, adv="tok", use_ref=True, kl_coef=0.1)
    # it is a ValueError, and the check can be switched off (no host sync, no error)
    with pytest.raises(ValueError):
        _run(b, adv="tok", use_ref=True, kl_coef=0.1)
    _run(b, adv="tok", use_ref=True, kl_coef=0.1, check_finite=False)


def test_nonfinite_sequence_advantage_raises():
    b = make_batch(8)
    b["adv_seq"] = b["adv_seq"].clone()
    b["adv_seq"][0] = float("nan")
    with pytest.raises(NonFiniteInputError, match="`advantages`"):
        _run(b)
    b["adv_seq"][0] = 0.0
    b["adv_seq"][2] = float("nan")  # row 2 is fully masked: ignored
    _run(b)


@pytest.mark.parametrize("arg", ["mask", "old_logprobs", "inference_logprobs", "ref_logprobs", "advantages"])
def test_shape_mismatch_raises(arg):
    b = make_batch(9)
    lp = b["logprobs"]
    kwargs = dict(logprobs=lp, advantages=b["adv_seq"], mask=b["mask"])
    kwargs[arg] = torch.zeros(lp.shape[0], lp.shape[1] + 1, dtype=torch.float64)
    if arg == "mask":
        kwargs[arg] = kwargs[arg].bool()
    with pytest.raises(ValueError, match=rf"`{arg}` has shape \(7, 10\) but `logprobs` has shape \(7, 9\)"):
        grpo_loss(**kwargs)


def test_bad_arguments():
    b = make_batch(10)
    lp, adv, mask = b["logprobs"], b["adv_seq"], b["mask"]
    with pytest.raises(ValueError, match="2-D"):
        grpo_loss(lp[0], adv, mask[0])
    with pytest.raises(ValueError, match="`advantages` has shape"):
        grpo_loss(lp, adv[:3], mask)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="is_mode"):
        grpo_loss(lp, adv, mask, is_mode="clip")
    with pytest.raises(ValueError, match="clip_eps"):
        grpo_loss(lp, adv, mask, clip_eps=(-0.1, 0.2))
    with pytest.raises(ValueError, match="is_bounds"):
        grpo_loss(lp, adv, mask, is_bounds=(2.0, 0.5))
    with pytest.raises(ValueError, match="0/1"):
        grpo_loss(lp, adv, mask.double() * 0.5)
    with pytest.raises(ValueError, match="normalizer"):
        grpo_loss(lp, adv, mask, normalizer=-1)


def test_float_mask_and_low_precision_inputs():
    b = make_batch(11, poison=False)
    lp = b["logprobs"]
    ref_loss, _ = grpo_loss(lp, b["adv_seq"], b["mask"], inference_logprobs=b["inference"])
    loss, _ = grpo_loss(lp, b["adv_seq"], b["mask"].double(), inference_logprobs=b["inference"])
    assert loss.item() == ref_loss.item()
    loss16, _ = grpo_loss(lp.bfloat16(), b["adv_seq"].bfloat16(), b["mask"],
                          inference_logprobs=b["inference"].bfloat16())
    assert loss16.dtype == torch.float32


def test_finalize_metrics_means():
    b = make_batch(12)
    _, _, metrics = _run(b, use_ref=True, kl_coef=0.1)
    _, _, r = _ref(b, use_ref=True, kl_coef=0.1)
    means = finalize_metrics(metrics)
    assert set(means) == {"tokens", "sequences", "advantage_mean", "is_abs_log_ratio_mean",
                          "is_masked_frac", "is_weight_mean", "clip_frac", "kl_mean"}
    assert means["is_abs_log_ratio_mean"].item() == pytest.approx(r["is_abs_log_ratio_sum"] / r["tokens"], abs=1e-12)
    assert means["is_masked_frac"].item() == pytest.approx(r["is_masked_tokens"] / r["tokens"], abs=1e-12)
    assert means["clip_frac"].item() == pytest.approx(r["clipped_tokens"] / r["tokens"], abs=1e-12)
    assert means["kl_mean"].item() == pytest.approx(r["kl_sum"] / r["tokens"], abs=1e-12)
    # plain numbers work too (e.g. after .item() on all-reduced tensors)
    plain = finalize_metrics({k: v.item() for k, v in metrics.items()})
    assert plain["clip_frac"] == pytest.approx(means["clip_frac"].item())
    with pytest.raises(KeyError, match="tokens"):
        finalize_metrics({"kl_sum": 1.0})


def test_is_weights_come_from_the_sampling_policy_in_later_ppo_epochs():
    """Second PPO epoch: the policy moved by +1 nat from pi_old, which equals pi_infer. The IS weight
    is pi_old / pi_infer = 1 (verl, NeMo-RL); before it was pi_theta / pi_infer = e > 2, so ICE-POP
    rejected every token and the loss was 0."""
    inference = torch.full((1, 4), -2.0, dtype=torch.float64)
    old = inference.clone()
    logprobs = (old + 1.0).requires_grad_(True)
    mask = torch.ones(1, 4)
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, metrics = grpo_loss(logprobs, adv, mask, old_logprobs=old, inference_logprobs=inference,
                              clip_eps=(0.2, 10.0))
    assert float(metrics["is_masked_tokens"]) == 0.0 and float(metrics["is_weight_sum"]) == 4.0
    assert float(loss) == pytest.approx(-math.e)
    ref_loss, _, ref_metrics = ref_grpo(logprobs, adv, mask, old=old, inference=inference, clip_eps=(0.2, 10.0))
    assert float(loss) == pytest.approx(ref_loss) and ref_metrics["is_masked_tokens"] == 0.0
