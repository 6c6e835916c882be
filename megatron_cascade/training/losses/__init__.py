"""Training losses by name (``LossSpec.kind``); see ``base.py`` for what a loss declares."""

from __future__ import annotations

from megatron_cascade.config.training import LossConfig
from megatron_cascade.training.losses.base import Loss, check_needs
from megatron_cascade.training.losses.grpo import GRPOLoss
from megatron_cascade.training.losses.mopd import MOPDLoss
from megatron_cascade.training.losses.sft import SFTLoss

LOSSES: dict[str, type] = {cls.name: cls for cls in (SFTLoss, GRPOLoss, MOPDLoss)}


def build_loss(name: str, cfg: LossConfig) -> Loss:
    """The loss registered as ``name``, configured by the ``loss`` section ``cfg``."""
    if name not in LOSSES:
        raise ValueError(f"loss {name!r} is not one of {sorted(LOSSES)}")
    return LOSSES[name](cfg)


__all__ = ["LOSSES", "Loss", "build_loss", "check_needs"]
