"""group_advantages / informative_groups / apply_overlong_policy."""

from __future__ import annotations

import math

import pytest
import torch

from alg_reference import ref_group_advantages
from megatron_cascade.algorithms import apply_overlong_policy, group_advantages, informative_groups


def test_known_values_std_normalized():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 2.0]])
    a = group_advantages(r, eps=0.0, std="population")
    # row 0: mean .5, population std .5; row 2: mean .5, std sqrt(.75)
    s = 0.75 ** 0.5
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0] * 4, [-0.5 / s] * 3 + [1.5 / s]])
    assert torch.allclose(a, expected, atol=1e-6)
    a_eps = group_advantages(r, std="population")  # default eps 1e-6
    assert a_eps[0, 0].item() == pytest.approx(0.5 / (0.5 + 1e-6), rel=1e-6)
    assert informative_groups(r).tolist() == [True, False, True]


def test_zero_std_rows_exactly_zero_despite_rounding():
    r = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]], dtype=torch.float64)
    for baseline in ("mean", "leave_one_out"):
        a = group_advantages(r, baseline=baseline)
        assert torch.equal(a, torch.zeros_like(a))
    assert informative_groups(r).tolist() == [False, False]


def test_without_std_and_leave_one_out():
    r = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    assert group_advantages(r, std_normalize=False).tolist() == [[-2.0, -1.0, 0.0, 3.0]]
    loo = group_advantages(r, std_normalize=False, baseline="leave_one_out")
    # r_i - (12 - r_i)/3
    assert torch.allclose(loo, torch.tensor([[-8 / 3, -4 / 3, 0.0, 4.0]]))
    loo_std = group_advantages(r, baseline="leave_one_out", eps=0.0)
    others_std = torch.tensor([[2.0, 3.0, 6.0], [1.0, 3.0, 6.0], [1.0, 2.0, 6.0], [1.0, 2.0, 3.0]]).std(dim=1)
    assert torch.allclose(loo_std, loo / others_std)


def test_leave_one_out_as_nemo_rl():
    """NeMo-RL's RLOO (``calculate_baseline_and_std_per_prompt`` + its GRPO estimator): baseline and
    std of the other responses, no division where the others agree. Before, the whole group's std was
    used: A = [1.5, -0.5, -0.5, -0.5] here instead of [1, -1/sqrt(3), ...]."""
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    a = group_advantages(r, baseline="leave_one_out", eps=0.0)
    # response 0: the others [0, 0, 0] agree (std 0) -> 1 - 0, undivided;
    # others: [1, 0, 0] -> mean 1/3, sample std sqrt(1/3) -> (0 - 1/3) / sqrt(1/3) = -sqrt(1/3)
    expected = torch.tensor([[1.0] + [-math.sqrt(1 / 3)] * 3], dtype=torch.float64)
    assert torch.allclose(a, expected, atol=1e-12, rtol=0)
    # NeMo-RL's formula written out: E_-i[r^2] - E_-i[r]^2, Bessel-corrected over the n - 1 others.
    n = r.shape[1]
    base = (r.sum() - r) / (n - 1)
    sq = ((r * r).sum() - r * r) / (n - 1)
    std = ((sq - base * base) * ((n - 1) / (n - 2))).sqrt()
    nemo = torch.where(std > 0, (r - base) / (std + 1e-6), r - base)
    assert torch.allclose(group_advantages(r, baseline="leave_one_out"), nemo, atol=1e-9, rtol=0)


def test_default_std_is_the_sample_std_as_verl_nemo_rl_and_trl():
    """verl, NeMo-RL and TRL divide by the Bessel-corrected group std (torch's default); before, the
    population std made every advantage sqrt(G / (G - 1)) times too large (1.155x at G = 4)."""
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    expected = (r - r.mean()) / (r.std() + 1e-6)  # torch.std: unbiased
    assert torch.allclose(group_advantages(r), expected, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="`std` must be one of"):
        group_advantages(r, std="unbiased")


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("std", ["sample", "population"])
def test_matches_reference_random(baseline, std_normalize, std):
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (16, 6), generator=g).double() + 0.25 * torch.randn(16, 6, generator=g, dtype=torch.float64)
    r[3] = 1.0  # constant group
    r[5] = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    valid = torch.rand(16, 6, generator=g) < 0.8
    valid[7] = False
    valid[8] = torch.tensor([True, False, False, False, False, False])  # single valid response
    for v in (None, valid):
        a = group_advantages(r, baseline=baseline, std_normalize=std_normalize, valid=v, std=std)
        ref = torch.tensor(ref_group_advantages(r, baseline=baseline, std_normalize=std_normalize, valid=v,
                                                std_kind=std), dtype=torch.float64)
        assert a.dtype == torch.float64
        assert torch.allclose(a, ref, atol=1e-12, rtol=0)
    assert not informative_groups(r, valid)[7] and not informative_groups(r, valid)[8]
    assert not informative_groups(r)[3] and informative_groups(r)[5]


def test_valid_mask_excludes_responses_from_statistics():
    r = torch.tensor([[1.0, 0.0, 5.0, 1.0]])
    valid = torch.tensor([[True, True, False, True]])
    a = group_advantages(r, valid=valid, std_normalize=False)
    assert torch.allclose(a, torch.tensor([[1 / 3, -2 / 3, 0.0, 1 / 3]]))


def test_integer_rewards_and_errors():
    a = group_advantages(torch.tensor([[1, 0]]), eps=0.0, std="population")
    assert a.dtype == torch.float32 and a.tolist() == [[1.0, -1.0]]
    with pytest.raises(ValueError, match="2-D"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(torch.zeros(2, 2), baseline="median")
    with pytest.raises(ValueError, match=r"non-finite.*prompt=1, response=0"):
        group_advantages(torch.tensor([[0.0, 1.0], [float("nan"), 1.0]]))
    with pytest.raises(ValueError, match=r"`valid` has shape \(2, 3\) but `rewards` has shape \(2, 2\)"):
        group_advantages(torch.zeros(2, 2), valid=torch.ones(2, 3, dtype=torch.bool))
    # NaN reward of an invalid response is ignored
    ok = group_advantages(torch.tensor([[0.0, 1.0, float("nan")]]), valid=torch.tensor([[True, True, False]]))
    assert torch.isfinite(ok).all()


def test_overlong_policies():
    r = torch.tensor([[1.0, 0.5, 1.0, 0.0]])
    fin = torch.tensor([[True, False, False, True]])
    z, keep = apply_overlong_policy(r, fin, policy="zero")
    assert z.tolist() == [[1.0, 0.0, 0.0, 0.0]] and keep.all()
    m, keep = apply_overlong_policy(r, fin, policy="mask")
    assert torch.equal(m, r) and torch.equal(keep, fin)
    assert m is not r  # no aliasing of the caller's tensor
    # masked responses leave the group statistics and get advantage 0
    a = group_advantages(m, valid=keep, eps=0.0, std="population")
    assert a.tolist() == [[1.0, 0.0, 0.0, -1.0]]
    with pytest.raises(ValueError, match="policy"):
        apply_overlong_policy(r, fin, policy="drop")
    with pytest.raises(ValueError, match="`finished` has shape"):
        apply_overlong_policy(r, fin[:, :2])
