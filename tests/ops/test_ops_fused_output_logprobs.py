"""fused_output_logprobs (output layer + log-probs, chunked, logits recomputed in backward) against a
float64 reference that materialises the logits: values, entropy and the gradients of hidden and weight,
on one process and at TP=2."""

import pytest
import torch

from megatron_cascade.ops import fused_output_logprobs, vocab_parallel_logprobs
from megatron_cascade.testing import run_distributed

HIDDEN, VOCAB, REAL = 16, 48, 45  # 3 padding columns, never in the distribution
SHAPE = (5, 7)  # 35 tokens: chunks of 4 leave a remainder


def _data(seed=0, vocab=VOCAB, real=REAL, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*SHAPE, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, HIDDEN, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    targets = torch.randint(0, real, SHAPE, generator=gen)
    grad_out = torch.randn(*SHAPE, generator=gen, dtype=torch.float64)
    return hidden, weight, targets, grad_out


def _reference(hidden, weight, targets, grad_out, temperature=1.0, real=REAL):
    """Full logits in float64, padding columns sliced off: log-probs, entropy, grad hidden, grad weight."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    x = (h @ w.t())[..., :real] / temperature
    logp = torch.log_softmax(x, -1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (lp * grad_out).sum().backward()
    entropy = -(logp.exp() * logp).sum(-1)
    return lp.detach(), entropy.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_single_process_matches_float64_reference(chunk_size, temperature):
    hidden, weight, targets, grad_out = _data()
    ref_lp, ref_ent, ref_gh, ref_gw = _reference(hidden, weight, targets, grad_out, temperature)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fused_output_logprobs(h, w, targets, temperature=temperature, vocab_size=REAL, with_entropy=True,
                                    chunk_size=chunk_size)
    (lp * grad_out).sum().backward()
    assert lp.dtype == torch.float64 and lp.shape == SHAPE and not ent.requires_grad
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-10, rtol=0)
    torch.testing.assert_close(h.grad, ref_gh, atol=1e-10, rtol=0)
    torch.testing.assert_close(w.grad, ref_gw, atol=1e-10, rtol=0)
    assert torch.equal(h.detach(), hidden) and torch.equal(w.detach(), weight), "inputs were modified"


def test_padding_rows_of_the_weight_get_no_gradient_and_all_columns_count_without_vocab_size():
    hidden, weight, targets, grad_out = _data(seed=1)
    w = weight.clone().requires_grad_(True)
    (fused_output_logprobs(hidden, w, targets, vocab_size=REAL, chunk_size=4) * grad_out).sum().backward()
    assert torch.all(w.grad[REAL:] == 0)
    ref_lp, _, _, ref_gw = _reference(hidden, weight, targets, grad_out, real=VOCAB)
    w.grad = None
    lp = fused_output_logprobs(hidden, w, targets, chunk_size=4)
    (lp * grad_out).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(w.grad, ref_gw, atol=1e-10, rtol=0)


def test_gradient_of_one_input_only_and_no_grad_mode():
    hidden, weight, targets, grad_out = _data(seed=2)
    ref_lp, _, ref_gh, _ = _reference(hidden, weight, targets, grad_out)
    h = hidden.clone().requires_grad_(True)
    (fused_output_logprobs(h, weight, targets, vocab_size=REAL, chunk_size=3) * grad_out).sum().backward()
    torch.testing.assert_close(h.grad, ref_gh, atol=1e-10, rtol=0)
    with torch.no_grad():
        lp = fused_output_logprobs(h, weight, targets, vocab_size=REAL)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-6)])
def test_16_and_32_bit_inputs_accumulate_in_float32(dtype, tol):
    """bf16 logits are rounded to bf16 as the output layer would produce them, then the softmax runs in
    float32: equal to the unfused path (F.linear, upcast, / T, vocab_parallel_logprobs)."""
    hidden, weight, targets, grad_out = _data(seed=3, dtype=dtype)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = fused_output_logprobs(h, w, targets, temperature=0.8, vocab_size=REAL, chunk_size=4)
    (lp.double() * grad_out).sum().backward()
    assert lp.dtype == torch.float32 and h.grad.dtype == dtype and w.grad.dtype == dtype
    unfused = vocab_parallel_logprobs(torch.nn.functional.linear(hidden, weight).float() / 0.8, targets,
                                      vocab_size=REAL)
    torch.testing.assert_close(lp, unfused, atol=tol, rtol=0)
    ref_lp, _, ref_gh, ref_gw = _reference(hidden, weight, targets, grad_out, 0.8)
    loose = 1e-5 if dtype == torch.float32 else 0.1  # bf16 logits carry ~3 significant digits
    torch.testing.assert_close(lp.double(), ref_lp, atol=loose, rtol=0)
    torch.testing.assert_close(h.grad.double(), ref_gh, atol=loose, rtol=0.02)
    torch.testing.assert_close(w.grad.double(), ref_gw, atol=loose, rtol=0.02)


def test_bfloat16_weight_gradient_sums_chunks_in_float32():
    """One token per chunk over 512 tokens: summed in bf16, the weight gradient was 6x further from the
    float64 value (0.29) than the unfused path's single GEMM (0.046); summed in float32, 0.049."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(512, HIDDEN, generator=gen).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5).bfloat16()
    targets, grad_out = torch.randint(0, VOCAB, (512,), generator=gen), torch.randn(512, generator=gen)
    _, _, _, ref_gw = _reference(hidden, weight, targets, grad_out.double(), real=VOCAB)
    unfused = weight.clone().requires_grad_(True)
    (vocab_parallel_logprobs(torch.nn.functional.linear(hidden, unfused).float(), targets) * grad_out).sum().backward()
    w = weight.clone().requires_grad_(True)
    (fused_output_logprobs(hidden, w, targets, chunk_size=1) * grad_out).sum().backward()
    unfused_err = (unfused.grad.double() - ref_gw).abs().max()
    assert (w.grad.double() - ref_gw).abs().max() <= 1.5 * unfused_err


def test_float32_log_sum_exp_keeps_its_precision_next_to_a_very_low_logit():
    """The log-sum-exp comes from a log_softmax buffer, read at the row's maximum; read at column 0 (a
    logit of about -7e3 here) it lost ~eps * 7e3 = 4e-4."""
    hidden, weight, targets, grad_out = _data(seed=6)
    hidden, weight, targets = hidden.abs(), weight.clone(), targets.clamp(min=1)
    weight[0] = -400.0  # logit 0 of every token ~ -7e3 (and no target: its own log-prob is that large)
    ref_lp = _reference(hidden, weight, targets, grad_out, real=VOCAB)[0]
    lp = fused_output_logprobs(hidden.float(), weight.float(), targets, chunk_size=4)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)


def test_bad_input_is_a_clear_error():
    hidden, weight, targets, _ = _data()
    with pytest.raises(ValueError, match="targets shape"):
        fused_output_logprobs(hidden, weight, targets[:, :-1])
    with pytest.raises(ValueError, match="weight shape"):
        fused_output_logprobs(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="share one float dtype"):
        fused_output_logprobs(hidden, weight.float(), targets)
    with pytest.raises(ValueError, match="temperature"):
        fused_output_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_output_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="padding id"):
        fused_output_logprobs(hidden, weight, torch.full_like(targets, 46), vocab_size=REAL)


def _tp2_worker(hidden, weight, targets, grad_out, real, reduce_hidden_grad):
    rank, group = torch.distributed.get_rank(), torch.distributed.group.WORLD
    h = hidden.clone().requires_grad_(True)
    w = weight.chunk(2, dim=0)[rank].clone().requires_grad_(True)
    lp, ent = fused_output_logprobs(h, w, targets, temperature=0.7, group=group, vocab_size=real, chunk_size=4,
                                    with_entropy=True, reduce_hidden_grad=reduce_hidden_grad)
    (lp * grad_out).sum().backward()
    return lp.detach(), ent, h.grad, w.grad, torch.equal(h.detach(), hidden)


def _tp2_cases(hidden, weight, targets, grad_out, padded_targets):
    """Three TP=2 runs in one process group: 3 padding columns (reduced and partial hidden gradient),
    and a vocabulary of 20 of 48 columns, so that rank 1's shard is padding only."""
    return [_tp2_worker(hidden, weight, targets, grad_out, REAL, True),
            _tp2_worker(hidden, weight, targets, grad_out, REAL, False),
            _tp2_worker(hidden, weight, padded_targets, grad_out, 20, True)]


@pytest.mark.distributed
def test_tp2_matches_single_rank_float64_reference():
    """Each rank holds half the vocabulary rows of the weight: the log-probs and entropy equal the
    reference on both ranks, the weight gradients concatenate to the reference's, and the hidden gradient
    is the full one on each rank (all-reduced) or, with reduce_hidden_grad=False, sums to it."""
    hidden, weight, targets, grad_out = _data(seed=5)
    padded_targets = targets % 20
    per_rank = run_distributed(_tp2_cases, 2, hidden, weight, targets, grad_out, padded_targets, cpu_mode=False)
    cases = [(targets, REAL, True), (targets, REAL, False), (padded_targets, 20, True)]
    for case, (tgt, real, reduced) in enumerate(cases):
        ref_lp, ref_ent, ref_gh, ref_gw = _reference(hidden, weight, tgt, grad_out, 0.7, real=real)
        results = [per_rank[rank][case] for rank in range(2)]
        for lp, ent, gh, _, unchanged in results:
            torch.testing.assert_close(lp, ref_lp, atol=1e-10, rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=1e-10, rtol=0)
            assert unchanged, "hidden was modified"
            if reduced:
                torch.testing.assert_close(gh, ref_gh, atol=1e-10, rtol=0)
        if not reduced:
            torch.testing.assert_close(results[0][2] + results[1][2], ref_gh, atol=1e-10, rtol=0)
            assert not torch.allclose(results[0][2], ref_gh), "a partial gradient should not be the full one"
        torch.testing.assert_close(torch.cat([r[3] for r in results]), ref_gw, atol=1e-10, rtol=0)
