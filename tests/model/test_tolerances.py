"""The layout tolerance: passes a reordered fp32 sum, fails an error a layout bug would make."""

import pytest
import torch

from megatron_cascade.testing.tolerances import assert_equal_up_to_summation_order


def _sum_rows(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """Row sums of fp32 ``x`` as ``chunks`` partial sums added afterwards (a TP/DP reduction)."""
    return torch.stack([c.sum(dim=1) for c in x.chunk(chunks, dim=1)]).sum(dim=0)


def test_reordered_sums_pass_and_a_missing_partial_sum_fails():
    g = torch.Generator().manual_seed(0)
    # Terms of 50 that cancel: small results carry the roundoff of large summands.
    x = torch.randn(64, 4096, generator=g) * 50
    ref = x.double().sum(dim=1).float()
    for chunks in (1, 2, 8, 64):
        assert_equal_up_to_summation_order(_sum_rows(x, chunks), ref, f"{chunks} partial sums")
    # The orders do give different digits (so the passes above are not vacuous).
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_sum_rows(x, 64), ref, atol=1e-7, rtol=1e-7)
    dropped = x[:, : 4096 // 2].sum(dim=1)  # one rank's partial sum never arrived
    with pytest.raises(AssertionError, match="missing all-reduce"):
        assert_equal_up_to_summation_order(dropped, ref, "missing all-reduce")
    off_by_one = ref.clone()
    off_by_one[3] += 1e-3 * ref.abs().max()  # one entry wrong by 0.1% of the scale
    with pytest.raises(AssertionError):
        assert_equal_up_to_summation_order(off_by_one, ref)


def test_an_all_zero_reference_must_be_matched_exactly():
    assert_equal_up_to_summation_order(torch.zeros(3), torch.zeros(3))
    with pytest.raises(AssertionError):
        assert_equal_up_to_summation_order(torch.tensor([0.0, 1e-30, 0.0]), torch.zeros(3))
