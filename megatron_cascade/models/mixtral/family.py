"""Mixtral (``MixtralForCausalLM``): Llama with an MoE block in every layer
(``block_sparse_moe.gate`` router; ``block_sparse_moe.experts.N.w1`` gate, ``w3`` up, ``w2`` down, each
expert ``intermediate_size`` wide); the router's softmax over all experts, then the top-k renormalised,
which is Megatron's softmax over the top-k logits (``router_pre_softmax: false``).

``router_jitter_noise`` only acts in Hugging Face training; the weights convert whatever it is. A set
``sliding_window`` (Mistral-style attention) is refused.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_cascade.config.model import ModelConfig, MoEConfig
from megatron_cascade.models.errors import ConversionError
from megatron_cascade.models.llama.family import LlamaFamily


class MixtralFamily(LlamaFamily):
    name = "mixtral"
    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    moe = True

    def _refuse_unsupported(self, hf: dict[str, Any], source: str) -> None:
        super()._refuse_unsupported(hf, source)
        if hf.get("sliding_window"):  # Mistral-style: a window is used whenever one is set
            self._refuse(source, f"sliding-window attention (sliding_window={hf['sliding_window']})")

    def _moe_config(self, hf: dict[str, Any]) -> Optional[MoEConfig]:
        return MoEConfig(num_experts=int(hf["num_local_experts"]), router_topk=int(hf["num_experts_per_tok"]),
                         ffn_hidden_size=int(hf["intermediate_size"]), router_pre_softmax=False,
                         router_load_balancing_type="none")

    def _moe_hf_fields(self, model: ModelConfig, hf: dict[str, Any]) -> None:
        hf.update(intermediate_size=model.moe.ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size,
                  num_local_experts=model.moe.num_experts, num_experts_per_tok=model.moe.router_topk)

    def _mlp_names(self, model: ModelConfig, m: str, h: str) -> dict[str, str]:
        block = h + "block_sparse_moe."
        names = {m + "mlp.router.weight": block + "gate.weight"}
        for e in range(model.moe.num_experts or 0):
            src, dst = f"{block}experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            names[dst + "linear_fc1.weight"] = f"{src}w1.weight+{src}w3.weight"  # SwiGLU [gate; up]
            names[dst + "linear_fc2.weight"] = src + "w2.weight"
        return names

    def check_supported(self, model: ModelConfig) -> None:
        super().check_supported(model)
        if model.moe.router_pre_softmax:
            raise ConversionError("Mixtral renormalises its top-k routing weights: model.moe.router_pre_softmax "
                                  "must be false to export as MixtralForCausalLM")


FAMILY = MixtralFamily()
