"""Stage types by name (``stages[].type``): what the config, the dry run and the runner need to know.

A stage type is one class (``StageType`` in ``stages/base.py``; a file per type in ``stages/``) plus one
entry here. The entry is declarative data the config owns — the loader and the dry run read it
without importing the trainer — and names the class as ``"module:Class"``, which
``stages.registry.stage_class`` imports when a stage runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageTypeEntry:
    """Declared properties of a stage type.

    Attributes:
        target: ``"package.module:Class"`` of its ``StageType`` subclass.
        loss: the training loss it optimises (``training/losses``).
        generates: samples responses from the policy (an RL-style stage) rather than training on
            reference responses.
        rewards: scores its responses with each domain's reward.
        teachers: needs ``teachers: {domain: stage name or folder}`` for every domain it trains on.
        kl_reference: keeps a frozen copy of the stage's start weights when ``loss.kl_coef`` > 0.
        groups: trains on groups of responses per prompt (``samples_per_prompt`` >= 2, uninformative
            groups filtered, dynamic sampling).
    """

    target: str
    loss: str
    generates: bool
    rewards: bool
    teachers: bool
    kl_reference: bool = False
    groups: bool = False


STAGE_TYPES: dict[str, StageTypeEntry] = {
    "sft": StageTypeEntry("megatron_cascade.stages.sft:SFTStage", loss="sft", generates=False, rewards=False,
                          teachers=False),
    "grpo": StageTypeEntry("megatron_cascade.stages.grpo:GRPOStage", loss="grpo", generates=True, rewards=True,
                           teachers=False, kl_reference=True, groups=True),
    "mopd": StageTypeEntry("megatron_cascade.stages.mopd:MOPDStage", loss="mopd", generates=True, rewards=True,
                           teachers=True),
    "distill": StageTypeEntry("megatron_cascade.stages.distill:DistillStage", loss="mopd", generates=True,
                              rewards=False, teachers=True),
}


def stage_type(name: str) -> StageTypeEntry:
    """The registry entry of ``name`` (a ``ValueError`` listing the known types otherwise)."""
    if name not in STAGE_TYPES:
        raise ValueError(f"stage type {name!r} is not one of {sorted(STAGE_TYPES)}")
    return STAGE_TYPES[name]
