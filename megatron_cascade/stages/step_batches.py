"""From examples and rollouts to ``TrainBatch``es (SFT targets, GRPO advantages, MOPD teachers)."""

from __future__ import annotations

import torch

from megatron_cascade.stages.prompt_data import Example
from megatron_cascade.rollout import RolloutBatch, pack_rollouts
from megatron_cascade.training import TrainBatch


def sft_batch(examples: list[Example], tokenizer) -> TrainBatch:
    """Prompt + reference response + eos per row; the loss covers the response and the eos."""
    rows, masks = [], []
    for example in examples:
        answer = tokenizer.encode(example.response) + [tokenizer.eos_id]
        rows.append(list(example.prompt_ids) + answer)
        masks.append([0] * (len(example.prompt_ids) - 1) + [1] * len(answer))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, (row, m) in enumerate(zip(rows, masks)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask)


def rollout_batch(rollouts: RolloutBatch, tokenizer, *, keep: torch.Tensor, advantages: torch.Tensor | None,
                  truncated: bool = False) -> TrainBatch:
    """Pack rollouts (prompt-major) into a batch; rows with ``keep`` False are masked out of the loss.

    Args:
        keep: [num_samples] bool, e.g. dynamic filtering of uninformative groups or overlong masking.
        advantages: [num_samples] GRPO advantages, or None (MOPD).
        truncated: the trainer's log-probs are of the top-k / top-p truncated distribution
            (``LossSpec.truncated``): the inference log-probs are then the sampler's of that same
            distribution, so that the IS ratio compares like with like.
    """
    packed = pack_rollouts(rollouts, pad_id=tokenizer.pad_id, logprobs="sampled" if truncated else "temperature")
    mask = packed.loss_mask * keep.to(packed.loss_mask.dtype).unsqueeze(1)
    return TrainBatch(input_ids=packed.tokens, target_ids=packed.targets, loss_mask=mask,
                      advantages=advantages, inference_logprobs=packed.inference_logprobs)
