"""Turning next-token logits into sampled tokens and their log-probs (pure tensor functions).

All functions take full (TP-gathered) logits ``[B, V_padded]``. Two log-probs come out per token:

* ``temperature_logprobs``: ``log_softmax(logits / T)`` over the real vocabulary (padded ids
  left out), the trainer's convention (``vocab_parallel_logprobs(..., vocab_size=V)``);
* ``sampled_logprobs``: under the distribution actually sampled from: temperature, padded
  vocabulary ids removed, then top-k, then top-p, renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_cascade.ops.filters import filter_top_k_top_p, mask_padded_vocab
from megatron_cascade.rollout.params import SamplingParams


@dataclass
class SampleOutput:
    """Per row of a step: the sampled token and its two log-probs (float32 nats), all ``[B]``."""

    tokens: torch.Tensor
    temperature_logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor


def temperature_logprobs(logits: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    """``log_softmax(logits / T)`` in float32 over the real vocabulary (T=0 is treated as T=1): ``[B, V]``.

    Padded ids get -inf, exactly as the trainer leaves them out of its softmax.
    """
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(mask_padded_vocab(logits.float(), vocab_size) / t, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, vocab_size: int,
           generator: torch.Generator | None, gumbel: torch.Tensor | None = None) -> SampleOutput:
    """Sample one token per row of ``logits [B, V_padded]``.

    Sampling uses the Gumbel-max trick with noise ``gumbel [B, V_padded]`` when given (``generate``
    passes counter-based noise, see ``noise.py``), else drawn from ``generator``; the result is a
    pure function of the logits and the noise: every tensor-parallel rank, given the same gathered
    logits and the same noise, picks the same tokens.
    """
    logits = logits.float()
    full_logprobs = temperature_logprobs(logits, params.temperature, vocab_size)
    allowed = mask_padded_vocab(logits, vocab_size)
    if params.greedy:
        tokens = allowed.argmax(dim=-1)
        sampled_lp = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    else:
        filtered = filter_top_k_top_p(allowed / params.temperature, params.top_k, params.top_p)
        noise = gumbel if gumbel is not None else _gumbel_noise(filtered.shape, generator, filtered.device)
        tokens = (filtered + noise).argmax(dim=-1)
        sampled_lp = _pick(torch.log_softmax(filtered, dim=-1), tokens)
    return SampleOutput(tokens, _pick(full_logprobs, tokens), sampled_lp)


def _gumbel_noise(shape: torch.Size, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    # -log(-log U) is Gumbel(0, 1); the clamp keeps log() finite at U in {0, 1}.
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    return -torch.log(-torch.log(u.clamp_(tiny, 1.0 - 1e-7)))


def _pick(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
