"""How far two fp32 results may differ when only the order of their sums differs (parallel layouts).

A layout (TP, PP, EP, DP) computes the same sums as one process, split into partial sums that are
added in another order: each partial sum is rounded on its own, so the results differ by a few units
of roundoff *of the summands*, not of the result. An entry that is small because its terms cancel
(a gradient near 0 beside entries of 50) carries the absolute error of the large terms, so a
tolerance relative to each entry (``rtol``) plus a fixed ``atol`` fails by chance on one machine and
passes on another. The bound here is relative to the tensor's scale (its largest magnitude).
"""

from __future__ import annotations

import torch

FP32_UNIT_ROUNDOFF = 2.0 ** -24
# Measured: the dense TP=2/PP=2/DP=2 and MoE EP=2 layouts of tests/model/test_layouts.py differ from one
# process by at most 11 roundoffs of the tensor's scale (embedding gradient: 1.3e-5 at scale 58). A bug
# (a missing all-reduce, a shard in the wrong place, a token routed twice) is off by O(1) of the scale.
SUMMATION_ORDER_ROUNDOFFS = 64


def assert_equal_up_to_summation_order(got: torch.Tensor, ref: torch.Tensor, name: str = "",
                                        roundoffs: int = SUMMATION_ORDER_ROUNDOFFS) -> None:
    """``got`` equals fp32 ``ref`` within ``roundoffs`` fp32 roundoffs of ``ref``'s largest magnitude
    (an all-zero ``ref`` must be matched exactly). Raises ``AssertionError`` naming ``name``."""
    atol = roundoffs * FP32_UNIT_ROUNDOFF * ref.abs().max().item()
    torch.testing.assert_close(got, ref, atol=atol, rtol=0,
                               msg=lambda m: f"{name}: {m} (tolerance {roundoffs} fp32 roundoffs of the "
                                             f"tensor's scale = {atol:.3g})")
