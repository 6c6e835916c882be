"""What a training loss declares to the Megatron plug-in (``training/loss_plugin.py``).

A loss is one object built from the ``loss`` config section. It states which ``TrainBatch`` fields
it reads (a batch without them is refused before the forward), whether its global normaliser counts
tokens or sequences, and the metric sums it returns (all-reduced over micro-batches and ranks, then
turned into means by ``algorithms.finalize_metrics``). Adding a loss is one file here plus one entry
in ``losses/__init__.py``.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Protocol

import torch

from megatron_cascade.config.training import LossConfig
from megatron_cascade.training.batch import TrainBatch

Normalization = Literal["token", "sequence"]
# loss.importance_correction -> the is_mode of the pure losses ("none": no inference log-probs passed)
_IS_MODES = {"icepop": "mask", "truncate": "truncate"}


class Loss(Protocol):
    """A training objective on per-token log-probs of the policy.

    Attributes:
        name: registry name.
        needs: ``TrainBatch`` fields (besides ``loss_mask``) that must be present.
        normalization: "token" (N = loss tokens) or "sequence" (N = sequences with a loss token).
        metric_keys: the keys of the metric sums ``__call__`` returns.
    """

    name: ClassVar[str]
    needs: tuple[str, ...]
    normalization: Normalization
    metric_keys: tuple[str, ...]

    def __call__(self, logprobs: torch.Tensor, micro: TrainBatch, normalizer: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metric sums)`` of one micro-batch: the micro-batch's share of the global loss
        (its partial sum divided by the global ``normalizer``). logprobs [b, S] float32."""
        ...


def importance_inputs(cfg: LossConfig, micro: TrainBatch) -> tuple[torch.Tensor | None, str]:
    """The inference log-probs the IS correction compares with (None when it is off) and its mode."""
    if cfg.importance_correction == "none":
        return None, "mask"
    return micro.inference_logprobs, _IS_MODES[cfg.importance_correction]


# A log-prob at or below this (nats) is of a token outside the trainer's top-k/top-p set: the
# truncated op's floor (``ops/truncated_logprobs.LOGPROB_FLOOR``), probability 0 in float32.
OFF_SUPPORT_LOGPROB = -1e4
OFF_SUPPORT_METRIC = "off_support_tokens"


def on_support(logprobs: torch.Tensor, micro: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss mask without tokens that the current or the old policy's truncated distribution
    cannot produce (the sampler kept them, the trainer's filter did not: the two computed the
    top-p boundary from logits that differ in the last bits), and their count (float64 scalar).

    Such a token has a probability ratio of 0 or infinity; it leaves the loss — like an IS-rejected
    token it still counts in the global normaliser, which was fixed before the forward — and is
    counted (``off_support_frac``), as NeMo-RL masks -inf log-probs."""
    mask = micro.loss_mask.bool()
    ok = logprobs.detach() > OFF_SUPPORT_LOGPROB
    if micro.old_logprobs is not None:
        ok = ok & (micro.old_logprobs > OFF_SUPPORT_LOGPROB)
    kept = mask & ok
    return kept.to(micro.loss_mask.dtype), (mask & ~ok).sum().to(torch.float64)


def check_needs(loss: Loss, micro: TrainBatch) -> None:
    """Refuse a micro-batch that lacks a field ``loss`` reads (a clear error, not a None deep inside)."""
    missing = [name for name in loss.needs if getattr(micro, name) is None]
    if missing:
        raise ValueError(f"the {loss.name} loss needs TrainBatch.{', TrainBatch.'.join(missing)}")
