"""Stage types (sft, grpo, mopd, distill): the per-type part of a cascade stage.

The declarations live with the config (``config/stage_types.py``: the loader and the dry run read
them); the classes are imported when a stage runs (``stage_class``).
"""

from megatron_cascade.config.stage_types import STAGE_TYPES, StageTypeEntry, stage_type
from megatron_cascade.stages.registry import stage_class

__all__ = ["STAGE_TYPES", "StageTypeEntry", "stage_class", "stage_type"]
