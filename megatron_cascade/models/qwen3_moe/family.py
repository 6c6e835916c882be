"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): Qwen3 with an MoE block in every layer
(``mlp.gate`` router; ``mlp.experts.N.{gate,up,down}_proj``; top-k softmax, renormalised when
``norm_topk_prob``)."""

from __future__ import annotations

from typing import Any, Optional

from megatron_cascade.config.model import ModelConfig, MoEConfig
from megatron_cascade.models.qwen3.family import Qwen3Family


class Qwen3MoeFamily(Qwen3Family):
    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    moe = True

    def _refuse_unsupported(self, hf: dict[str, Any], source: str) -> None:
        super()._refuse_unsupported(hf, source)
        if hf.get("mlp_only_layers"):
            self._refuse(source, f"mlp_only_layers={hf['mlp_only_layers']} (dense layers between MoE layers)")
        if hf.get("decoder_sparse_step", 1) != 1:
            self._refuse(source, f"decoder_sparse_step={hf['decoder_sparse_step']} (MoE only every k-th layer)")
        if hf.get("shared_expert_intermediate_size"):
            self._refuse(source, "shared experts")

    def _moe_config(self, hf: dict[str, Any]) -> Optional[MoEConfig]:
        return MoEConfig(num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                         router_topk=int(hf["num_experts_per_tok"]), ffn_hidden_size=int(hf["moe_intermediate_size"]),
                         router_pre_softmax=not hf.get("norm_topk_prob", False), router_load_balancing_type="none")

    def _moe_hf_fields(self, model: ModelConfig, hf: dict[str, Any]) -> None:
        experts_key = "num_local_experts" if "num_local_experts" in hf and "num_experts" not in hf else "num_experts"
        hf[experts_key] = model.moe.num_experts
        hf.update(num_experts_per_tok=model.moe.router_topk, moe_intermediate_size=model.moe.ffn_hidden_size,
                  norm_topk_prob=not model.moe.router_pre_softmax, decoder_sparse_step=1, mlp_only_layers=[])

    def _mlp_names(self, model: ModelConfig, m: str, h: str) -> dict[str, str]:
        names = {m + "mlp.router.weight": h + "mlp.gate.weight"}
        for e in range(model.moe.num_experts or 0):
            src, dst = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            names[dst + "linear_fc1.weight"] = f"{src}gate_proj.weight+{src}up_proj.weight"
            names[dst + "linear_fc2.weight"] = src + "down_proj.weight"
        return names


FAMILY = Qwen3MoeFamily()
