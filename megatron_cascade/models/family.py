"""``ModelFamily``: what the project knows of one Hugging Face architecture, in one place.

A family maps its ``config.json`` to a ``ModelConfig`` and back, names its tensors on both sides
(Megatron names are those of the local-spec model at TP=PP=EP=1; ``convert/spec_names.py`` moves them
onto the Transformer Engine spec's names), and refuses what the Megatron model cannot reproduce. The
conversion engine (``convert/``) and the registry (``registry.py``) ask a family; they never test
which family it is.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from megatron_cascade.config.model import ModelConfig


class ModelFamily:
    """One Hugging Face architecture. Subclasses set the class attributes and the hooks below.

    Attributes:
        name: the family's folder name under ``models/`` (``llama``, ``nemotron_h``, ...).
        architecture: ``architectures[0]`` of its HF config (``LlamaForCausalLM``).
        model_type: ``model_type`` of its HF config (``llama``).
        megatron_architecture: the ``model.architecture`` it builds (``architectures/``: ``gpt`` is
            GPTModel, ``hybrid`` MambaModel).
    """

    name: ClassVar[str]
    architecture: ClassVar[str]
    model_type: ClassVar[str]
    megatron_architecture: ClassVar[str] = "gpt"

    def claims(self, model: ModelConfig) -> bool:
        """Whether a model config without a recorded HF config exports as this family (the registry
        asks the families in order; the first that claims it wins)."""
        raise NotImplementedError

    def model_config(self, hf: dict[str, Any], source: str, *, make_vocab_size_divisible_by: int,
                     precision: str) -> ModelConfig:
        """The ``ModelConfig`` of an HF config dict read from ``source``; ``ConversionError`` (naming
        the HF key) for what the Megatron model cannot reproduce."""
        raise NotImplementedError

    def hf_config(self, model: ModelConfig, template: Optional[dict[str, Any]]) -> dict[str, Any]:
        """The HF config dict of ``model``: ``template`` (the config imported from, if any) updated;
        the dtype key is the caller's."""
        raise NotImplementedError

    def global_names(self, model: ModelConfig) -> dict[str, str]:
        """Megatron name -> HF name for the tensors outside the decoder layers."""
        raise NotImplementedError

    def layer_names(self, model: ModelConfig, layer: int) -> dict[str, str]:
        """Megatron name -> HF name (or ``+``-joined HF names, concatenated along dim 0) for decoder
        layer ``layer``."""
        raise NotImplementedError

    def check_supported(self, model: ModelConfig) -> None:
        """``ConversionError`` if ``model`` needs features this family's map does not cover."""
        raise NotImplementedError

    def all_hf_names(self, model: ModelConfig) -> set[str]:
        """Every HF tensor name a checkpoint of this family and config holds."""
        out = set(self.global_names(model).values())
        for layer in range(model.num_layers):
            for joined in self.layer_names(model, layer).values():
                out.update(joined.split("+"))
        return out

    def __repr__(self) -> str:
        return f"<family {self.name}: {self.architecture}>"
