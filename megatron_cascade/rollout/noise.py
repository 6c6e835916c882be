"""Counter-based Gumbel noise: the sampling noise of a response token is a pure function of
(seed, prompt index, sample index, response position, vocabulary id).

Why not one ``torch.Generator`` for the batch: with continuous batching the rows of a step change
as requests enter and leave, so a shared generator would hand a response different noise
depending on the KV budget, the admission order or the pipeline layout. Hashing the coordinates
makes a sampled response independent of all of that (and of which other prompts share the call),
so the paged generator, the recompute reference and every TP/PP layout sample the same tokens.

The hash is a 32-bit integer mixer evaluated in int64 with every product below 2**63 (multipliers
< 2**31, operands < 2**32), so it is exact on any device; 24 bits of it make the uniform.
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF
_C1, _C2, _C3 = 0x7FEB352D, 0x1B873593, 0x5BD1E995  # odd multipliers < 2**31


def _mix_int(x: int) -> int:
    """The mixer on a Python int (< 2**32), bit-identical to ``_mix``."""
    x &= _MASK
    x ^= x >> 16
    x = (x * _C1) & _MASK
    x ^= x >> 15
    x = (x * _C2) & _MASK
    x ^= x >> 16
    return x


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The mixer on an int64 tensor with values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _C2) & _MASK
    return x ^ (x >> 16)


def sample_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 32-bit noise key of one response (any-size non-negative ``seed``)."""
    key = _mix_int(seed & _MASK)
    key = _mix_int(key ^ ((seed >> 32) & _MASK))
    key = _mix_int(key ^ _mix_int(prompt_index))
    return _mix_int(key ^ _mix_int(sample_index + 0x9E37))


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[B, vocab]`` float32 for rows with noise ``keys [B]`` sampling their
    response token number ``positions [B]`` (0-based)."""
    keys = keys.to(torch.int64)
    row = _mix(keys ^ _mix((positions.to(torch.int64) * _C3) & _MASK))  # [B]
    ids = (torch.arange(vocab, device=keys.device, dtype=torch.int64) * _C3) & _MASK
    h = _mix(_mix(row.unsqueeze(1) ^ ids.unsqueeze(0)) ^ row.unsqueeze(1))
    # float64: 1 - 2**-25 (the largest u) would round to 1.0 in float32 and give infinite noise.
    u = ((h >> 8).to(torch.float64) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return (-torch.log(-torch.log(u))).to(torch.float32)
