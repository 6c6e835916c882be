"""Nemotron-H / Nemotron-3-Nano (``NemotronHForCausalLM``), the hybrid Mamba-2 model the paper post-trained."""

from megatron_cascade.models.nemotron_h.family import FAMILY, NemotronHFamily

__all__ = ["FAMILY", "NemotronHFamily"]
