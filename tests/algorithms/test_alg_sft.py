"""sft_loss against a plain float64 loop."""

import torch

from megatron_cascade.algorithms import finalize_metrics, sft_loss


def test_sft_loss_matches_reference_and_ignores_masked_nan():
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        lp[0, 3] = float("nan")  # masked: must not matter
    loss, metrics = sft_loss(lp, mask, normalizer=10)
    loss.backward()
    ref, grad = 0.0, torch.zeros(3, 5, dtype=torch.float64)
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                ref -= float(lp[b, t]) / 10
                grad[b, t] = -1 / 10
    assert abs(float(loss) - ref) < 1e-12
    torch.testing.assert_close(lp.grad, grad, atol=1e-12, rtol=0)
    out = finalize_metrics(metrics)
    assert out["tokens"] == 7 and out["sequences"] == 2
    assert abs(float(out["nll_mean"]) - ref * 10 / 7) < 1e-12
