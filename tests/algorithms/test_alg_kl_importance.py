"""KL estimators, importance weights, and tiny end-to-end sanity checks of the losses."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_cascade.algorithms import (
    group_advantages,
    grpo_loss,
    importance_weights,
    k1_kl,
    k2_kl,
    k3_kl,
    kl_penalty,
    mopd_loss,
)


def test_kl_estimators():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0, -3.0], dtype=torch.float64)
    for i in range(3):
        d = ref[i].item() - lp[i].item()
        assert k3_kl(lp, ref)[i].item() == pytest.approx(math.exp(d) - d - 1, abs=1e-15)
        assert k2_kl(lp, ref)[i].item() == pytest.approx(0.5 * d * d)
        assert k1_kl(lp, ref)[i].item() == pytest.approx(-d)
    assert (k3_kl(lp, ref) >= 0).all() and k3_kl(lp, ref)[0] == 0
    assert torch.equal(kl_penalty(lp, ref), k3_kl(lp, ref))
    assert torch.equal(kl_penalty(lp, ref, "k1"), k1_kl(lp, ref))
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(lp, ref, "k4")


def test_k3_is_unbiased_estimate_of_kl():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    y = torch.multinomial(p, 200_000, replacement=True, generator=g)
    est = k3_kl(p.log()[y], q.log()[y]).mean().item()
    exact = (p * (p / q).log()).sum().item()
    assert est == pytest.approx(exact, abs=3e-3)


def test_importance_weights_bounds_inclusive_and_modes():
    lp = torch.zeros(1, 6, dtype=torch.float64)
    r = torch.tensor([[0.4, 0.5, 1.0, 2.0, 2.5, 3.0]], dtype=torch.float64)
    inf = -r.log()  # exp(lp - inf) = r
    mask = torch.tensor([[True, True, True, True, True, False]])
    w, log_r, rej = importance_weights(lp, inf, mask, bounds=(0.5, 2.0), mode="mask")
    assert torch.allclose(w, torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.0, 0.0]], dtype=torch.float64))
    assert rej.tolist() == [[True, False, False, False, True, False]]
    assert torch.allclose(log_r[0, :5], r[0, :5].log()) and log_r[0, 5] == 0
    w, _, rej = importance_weights(lp, inf, mask, mode="truncate")
    assert torch.allclose(w, torch.tensor([[0.4, 0.5, 1.0, 2.0, 2.0, 0.0]], dtype=torch.float64))
    assert rej.tolist() == [[False, False, False, False, True, False]]
    w, log_r, rej = importance_weights(lp, None, mask)
    assert w.tolist() == [[1.0] * 5 + [0.0]] and not rej.any() and (log_r == 0).all()
    lp_g = lp.clone().requires_grad_(True)
    assert not importance_weights(lp_g, inf, mask).weights.requires_grad
    with pytest.raises(ValueError, match="mode"):
        importance_weights(lp, inf, mask, mode="clip")


def test_grpo_improves_softmax_policy():
    """Optimising a 4-token softmax policy with grpo_loss raises expected reward."""
    g = torch.Generator().manual_seed(0)
    reward = torch.tensor([0.0, 0.0, 1.0, 0.5])
    logits = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)
    start = (logits.softmax(0) * reward).sum().item()
    P, G = 4, 8
    for _ in range(40):
        probs = logits.softmax(0).detach()
        tokens = torch.multinomial(probs, P * G, replacement=True, generator=g)
        adv = group_advantages(reward[tokens].view(P, G)).view(-1)
        logp = logits.log_softmax(0)[tokens].view(-1, 1)
        loss, _ = grpo_loss(logp, adv, torch.ones_like(logp, dtype=torch.bool))
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = (logits.softmax(0) * reward).sum().item()
    assert start == pytest.approx(0.375) and end > 0.85


def test_mopd_reduces_reverse_kl_to_teacher():
    g = torch.Generator().manual_seed(0)
    teacher = torch.tensor([0.05, 0.15, 0.6, 0.2]).log()
    logits = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=1.0)

    def rkl() -> float:
        s = logits.log_softmax(0).detach()
        return (s.exp() * (s - teacher)).sum().item()

    start = rkl()
    for _ in range(60):
        tokens = torch.multinomial(logits.softmax(0).detach(), 64, replacement=True, generator=g)
        logp = logits.log_softmax(0)[tokens].view(8, 8)
        loss, _ = mopd_loss(logp, teacher[tokens].view(8, 8), torch.ones(8, 8, dtype=torch.bool))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert rkl() < 0.1 * start


def test_k3_is_clamped_as_verl_and_nemo_rl():
    """A token the reference finds far likelier (d = +30) gave exp(30) ~ 1e13 before; a far less likely
    one (d = -30) 29. Both now 10, with no gradient through the clamp; small d unchanged."""
    lp = torch.tensor([-30.0, 0.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0, -30.0, -1.5], dtype=torch.float64)
    kl = k3_kl(lp, ref)
    d = -0.5
    assert kl.tolist() == pytest.approx([10.0, 10.0, math.exp(d) - d - 1], abs=1e-15)
    kl.sum().backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 1 - math.exp(d)], abs=1e-15)
