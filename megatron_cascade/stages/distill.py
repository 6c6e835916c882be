"""On-policy distillation without rewards: MOPD's loss (sampled-token reverse KL to a teacher per
domain, IS-corrected) on domains that need no verifier — no reward is built, called or logged, so a
domain's rows need no ``answer`` and no reward server has to be up. Teachers as in MOPD."""

from __future__ import annotations

from megatron_cascade.stages.mopd import MOPDStage


class DistillStage(MOPDStage):
    """Registered as ``distill`` with ``rewards=False`` (``stages/registry.py``): the rollout base
    then generates without a scorer and logs lengths and finish rates only."""
