"""Nemotron-H / Nemotron-3-Nano (``NemotronHForCausalLM``): the hybrid Mamba-2 / attention / MLP / MoE
model, built as Megatron-Core's ``MambaModel`` (``model.architecture: hybrid``). Its config mapping is
``config.py``, its tensor names ``names.py``."""

from __future__ import annotations

from typing import Any, Optional

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.models.family import ModelFamily
from megatron_cascade.models.nemotron_h import config, names


class NemotronHFamily(ModelFamily):
    name = "nemotron_h"
    architecture = "NemotronHForCausalLM"
    model_type = "nemotron_h"
    megatron_architecture = "hybrid"

    def claims(self, model: ModelConfig) -> bool:
        return model.architecture == "hybrid"

    def model_config(self, hf: dict[str, Any], source: str, *, make_vocab_size_divisible_by: int,
                     precision: str) -> ModelConfig:
        return config.model_config(hf, source, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                   precision=precision)

    def hf_config(self, model: ModelConfig, template: Optional[dict[str, Any]]) -> dict[str, Any]:
        return config.hf_config(model, template)

    def global_names(self, model: ModelConfig) -> dict[str, str]:
        return names.global_names(model)

    def layer_names(self, model: ModelConfig, layer: int) -> dict[str, str]:
        return names.layer_names(model, layer)

    def check_supported(self, model: ModelConfig) -> None:
        names.check_supported(model)


FAMILY = NemotronHFamily()
