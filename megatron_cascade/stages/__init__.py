"""Stage types (sft, grpo, mopd, distill): the per-type part of a cascade stage.

Only the registry is imported here (cheap: the config loader uses it); the classes are imported
when a stage runs (``stage_class``).
"""

from megatron_cascade.stages.registry import STAGE_TYPES, StageTypeEntry, stage_class, stage_type

__all__ = ["STAGE_TYPES", "StageTypeEntry", "stage_class", "stage_type"]
