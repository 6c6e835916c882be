"""Packing a ``RolloutBatch`` into the padded tensors a training step consumes.

Alignment convention (the trainer's): every ``[B, S]`` tensor except ``tokens`` and
``position_ids`` is aligned to the *logits* position ``t``, which predicts token ``t + 1``:

* ``targets[b, t] = tokens[b, t + 1]`` (``pad_id`` in the last column and after the sequence);
* ``loss_mask[b, t] = 1`` iff ``targets[b, t]`` is a response token the model sampled (a
  multi-turn episode's observation tokens, ``response_mask`` 0, are context: mask 0);
* ``inference_logprobs[b, t]`` = the rollout's log-prob of ``targets[b, t]`` (0 where masked).

So for ``logits = model(tokens, position_ids)`` the trainer computes
``logprobs = vocab_parallel_logprobs(logits / T, targets)`` and compares it to
``inference_logprobs`` where ``loss_mask`` is 1, with no shifting anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from megatron_cascade.rollout.batch import RolloutBatch


@dataclass
class PackedRollouts:
    """Right-padded training tensors, all ``[B, S]`` unless noted.

    Attributes:
        tokens: prompt + response ids (long), then ``pad_id``.
        position_ids: 0..len-1 on each row (padding continues counting; it is masked anyway).
        targets: ``tokens`` shifted left by one (long).
        loss_mask: float32, 1 on the positions whose target is a response token.
        inference_logprobs: float32 nats, the rollout's log-prob of each target (0 where masked).
        prompt_lengths: ``[B]`` long.
        response_lengths: ``[B]`` long.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    inference_logprobs: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor


def pack_rollouts(batch: RolloutBatch, *, pad_id: int, seq_length: Optional[int] = None,
                  logprobs: Literal["temperature", "sampled"] = "temperature") -> PackedRollouts:
    """Pack ``batch`` into ``PackedRollouts`` (alignment: see the module docstring).

    Args:
        pad_id: filler token id.
        seq_length: width ``S``; default the longest prompt + response. Shorter raises ValueError.
        logprobs: "temperature": ``response_logprobs`` (trainer convention, the default);
            "sampled": ``sampled_logprobs`` (the truncated distribution actually sampled from).
    """
    if logprobs not in ("temperature", "sampled"):
        raise ValueError(f"logprobs={logprobs!r} must be 'temperature' or 'sampled'")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in batch]
    width = seq_length or max(lengths)
    if width < max(lengths):
        raise ValueError(f"seq_length={seq_length} is shorter than the longest sample ({max(lengths)} tokens)")
    b = len(batch)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.float32)
    inference_lp = torch.zeros((b, width), dtype=torch.float32)
    for row, s in enumerate(batch):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[row, :p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        # Response token i sits at column p + i and is predicted at position p + i - 1.
        # An episode (environments.EpisodeSample) marks which response tokens were sampled.
        sampled = getattr(s, "response_mask", None)
        loss_mask[row, p - 1:p - 1 + r] = 1.0 if sampled is None else torch.tensor(sampled, dtype=torch.float32)
        values = s.response_logprobs if logprobs == "temperature" else s.sampled_logprobs
        inference_lp[row, p - 1:p - 1 + r] = torch.tensor(values, dtype=torch.float32)
    targets = torch.full_like(tokens, pad_id)
    targets[:, :-1] = tokens[:, 1:]
    return PackedRollouts(
        tokens=tokens,
        position_ids=torch.arange(width).unsqueeze(0).expand(b, -1).contiguous(),
        targets=targets,
        loss_mask=loss_mask,
        inference_logprobs=inference_lp,
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in batch], dtype=torch.long),
        response_lengths=torch.tensor([len(s.response_ids) for s in batch], dtype=torch.long),
    )
