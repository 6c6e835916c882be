"""mopd_loss against the float64 token-loop reference, split invariance, masking and errors."""

from __future__ import annotations

import pytest
import torch

from alg_reference import make_batch, ref_mopd
from megatron_cascade.algorithms import (
    MOPD_METRIC_KEYS,
    NonFiniteInputError,
    finalize_metrics,
    mopd_loss,
)

TOL = 1e-10


def _run(b, *, use_inf=True, lp=None, **kw):
    lp = b["logprobs"].clone().requires_grad_(True) if lp is None else lp
    loss, metrics = mopd_loss(lp, b["teacher"], b["mask"],
                              inference_logprobs=b["inference"] if use_inf else None, **kw)
    return lp, loss, metrics


def _ref(b, *, use_inf=True, **kw):
    return ref_mopd(b["logprobs"], b["teacher"], b["mask"],
                    inference=b["inference"] if use_inf else None, **kw)


@pytest.mark.parametrize("normalization", ["sequence", "token"])
@pytest.mark.parametrize("use_inf", [False, True])
@pytest.mark.parametrize("is_mode", ["mask", "truncate"])
@pytest.mark.parametrize("normalizer", [None, 17.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference(seed, normalization, use_inf, is_mode, normalizer):
    b = make_batch(seed)
    kw = dict(use_inf=use_inf, is_mode=is_mode, normalization=normalization, normalizer=normalizer)
    lp, loss, metrics = _run(b, **kw)
    loss.backward()
    ref_loss, ref_grad, ref_metrics = _ref(b, **kw)
    assert abs(loss.item() - ref_loss) < TOL
    assert torch.isfinite(lp.grad).all()
    assert torch.allclose(lp.grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=0, atol=TOL)
    assert set(metrics) == set(MOPD_METRIC_KEYS)
    for k, v in metrics.items():
        assert v.dtype == torch.float64 and v.dim() == 0 and not v.requires_grad
        assert abs(v.item() - ref_metrics[k]) < 1e-9, k
    if use_inf:
        assert ref_metrics["is_masked_tokens"] > 0
    # the fully masked row does not count as a sequence
    assert metrics["sequences"].item() == int(b["mask"].any(dim=1).sum()) < b["mask"].shape[0]


def test_sequence_mean_weights_sequences_equally():
    """Without IS: sequence b gets gradient -a/(|V_b| * n_seq)."""
    b = make_batch(2, poison=False)
    lp, loss, _ = _run(b, use_inf=False)
    loss.backward()
    m = b["mask"].double()
    n_tok = m.sum(1, keepdim=True)
    n_seq = (n_tok > 0).sum()
    a = b["teacher"] - b["logprobs"]
    expected = -(a * m) / n_tok.clamp(min=1) / n_seq
    assert torch.allclose(lp.grad, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("normalization", ["sequence", "token"])
@pytest.mark.parametrize("split", [1, 3, 5])
def test_split_invariance(normalization, split):
    b = make_batch(5)
    lp_full, loss_full, m_full = _run(b, normalization=normalization)
    loss_full.backward()
    if normalization == "sequence":
        n_global = b["mask"].any(dim=1).sum()
    else:
        n_global = b["mask"].sum()
    lp = b["logprobs"].clone().requires_grad_(True)
    total, sums = 0.0, {k: 0.0 for k in m_full}
    for rows in (slice(0, split), slice(split, None)):
        part = {k: v[rows] for k, v in b.items()}
        _, loss, m = _run(part, lp=lp[rows], normalization=normalization, normalizer=n_global)
        total = total + loss
        sums = {k: sums[k] + m[k] for k in sums}
    total.backward()
    assert abs(total.item() - loss_full.item()) < TOL
    assert torch.allclose(lp.grad, lp_full.grad, atol=TOL, rtol=0)
    for k in m_full:
        assert abs(sums[k].item() - m_full[k].item()) < 1e-9, k


@pytest.mark.parametrize("normalization", ["sequence", "token"])
@pytest.mark.parametrize("normalizer", [None, 0])
def test_all_masked_batch(normalization, normalizer):
    b = make_batch(6)
    b["mask"] = torch.zeros_like(b["mask"])
    b["logprobs"] = torch.full_like(b["logprobs"], float("nan"))
    lp, loss, metrics = _run(b, normalization=normalization, normalizer=normalizer)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros_like(lp.grad))
    assert all(v.item() == 0 for v in metrics.values())
    assert all(v.item() == 0 for v in finalize_metrics(metrics).values())


@pytest.mark.parametrize("normalization", ["sequence", "token"])
def test_nan_at_masked_positions_has_no_effect(normalization):
    poisoned, clean = make_batch(7, poison=True), make_batch(7, poison=False)
    lp_p, loss_p, m_p = _run(poisoned, normalization=normalization)
    lp_c, loss_c, m_c = _run(clean, normalization=normalization)
    loss_p.backward()
    loss_c.backward()
    assert loss_p.item() == loss_c.item()
    assert torch.equal(lp_p.grad, lp_c.grad)
    assert (lp_p.grad[~poisoned["mask"]] == 0).all()
    assert all(m_p[k].item() == m_c[k].item() for k in m_p)


@pytest.mark.parametrize("key,arg", [("logprobs", "logprobs"), ("teacher", "teacher_logprobs"),
                                     ("inference", "inference_logprobs")])
def test_nonfinite_at_valid_position_raises(key, arg):
    b = make_batch(8)
    b[key] = b[key].clone()
    b[key][0, 4] = float("nan")
    with pytest.raises(NonFiniteInputError, match=rf"`{arg}`.*batch=0, token=4"):
        _run(b)
    _run(b, check_finite=False)


@pytest.mark.parametrize("arg", ["teacher_logprobs", "mask", "inference_logprobs"])
def test_shape_mismatch_raises(arg):
    b = make_batch(9)
    kwargs = dict(logprobs=b["logprobs"], teacher_logprobs=b["teacher"], mask=b["mask"])
    kwargs[arg] = torch.zeros(6, 9, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"`{arg}` has shape \(6, 9\) but `logprobs` has shape \(7, 9\)"):
        mopd_loss(**kwargs)


def test_bad_arguments():
    b = make_batch(10)
    with pytest.raises(ValueError, match="normalization"):
        mopd_loss(b["logprobs"], b["teacher"], b["mask"], normalization="batch")
    with pytest.raises(ValueError, match="is_mode"):
        mopd_loss(b["logprobs"], b["teacher"], b["mask"], is_mode="x")


def test_finalize_reverse_kl():
    b = make_batch(12)
    _, _, metrics = _run(b)
    _, _, r = _ref(b)
    means = finalize_metrics(metrics)
    assert set(means) == {"tokens", "sequences", "reverse_kl_mean", "is_abs_log_ratio_mean",
                          "is_masked_frac", "is_weight_mean"}
    assert means["reverse_kl_mean"].item() == pytest.approx(r["reverse_kl_sum"] / r["tokens"], abs=1e-12)
