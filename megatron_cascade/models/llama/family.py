"""Llama (``LlamaForCausalLM``): RMSNorm, SwiGLU, full RoPE, GQA, no biases — and the decoder map the
Llama-style families (Qwen2, Qwen3, Qwen3-MoE, Mixtral) extend with their flags and MoE block."""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Optional

from megatron_cascade.config.model import ModelConfig, MoEConfig
from megatron_cascade.models.errors import ConversionError
from megatron_cascade.models.family import ModelFamily
from megatron_cascade.models.hf_keys import rope, set_rope_theta


class LlamaFamily(ModelFamily):
    """Llama, and the base of every Llama-style family: a ``GPTModel`` with RMSNorm and SwiGLU.

    Flags a subclass sets: ``qkv_bias`` (q/k/v projections with a bias: Qwen2), ``qk_norm`` (RMSNorm
    of q and k per head: Qwen3), ``moe`` (with ``_moe_config``, ``_moe_hf_fields`` and ``_mlp_names``
    for its MoE block: Qwen3-MoE, Mixtral).
    """

    name = "llama"
    architecture = "LlamaForCausalLM"
    model_type = "llama"
    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False
    moe: ClassVar[bool] = False  # an MoE block in every layer (the subclass maps it)

    def claims(self, model: ModelConfig) -> bool:
        return (model.architecture == "gpt" and bool(model.moe.num_experts) == self.moe
                and model.qk_layernorm == self.qk_norm and model.add_qkv_bias == self.qkv_bias)

    # -- config.json ---------------------------------------------------------------------------
    def model_config(self, hf: dict[str, Any], source: str, *, make_vocab_size_divisible_by: int,
                     precision: str) -> ModelConfig:
        self._refuse_unsupported(hf, source)
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            cfg = ModelConfig(
                num_layers=int(hf["num_hidden_layers"]),
                hidden_size=hidden,
                ffn_hidden_size=int(hf["intermediate_size"]),
                num_attention_heads=heads,
                num_query_groups=int(hf.get("num_key_value_heads") or heads),
                kv_channels=int(hf.get("head_dim") or hidden // heads),
                vocab_size=int(hf["vocab_size"]),
                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                rotary_base=rope(hf)[0],
                norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
                add_qkv_bias=self.qkv_bias,
                qk_layernorm=self.qk_norm,
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                precision=precision,
            )
            moe = self._moe_config(hf)
            if moe is not None:
                cfg.moe = moe
        except KeyError as exc:
            raise ConversionError(f"{source}: required key {exc} is missing") from exc
        return cfg

    def _refuse_unsupported(self, hf: dict[str, Any], source: str) -> None:
        theta, scaling = rope(hf)
        if scaling is not None:
            self._refuse(source, f"RoPE scaling (rope_scaling type {scaling.get('rope_type', scaling.get('type'))!r})")
        if theta != int(theta):
            self._refuse(source, f"a non-integer rope_theta={theta}")
        if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
            self._refuse(source, "sliding-window attention (use_sliding_window / layer_types)")
        if hf.get("hidden_act", "silu") != "silu":
            self._refuse(source, f"hidden_act={hf.get('hidden_act')!r} (only silu/SwiGLU)")
        if hf.get("attention_bias") and not self.qkv_bias:
            self._refuse(source, "attention_bias=true")
        if hf.get("mlp_bias"):
            self._refuse(source, "mlp_bias=true")
        if hf.get("pretraining_tp", 1) != 1:
            self._refuse(source, f"pretraining_tp={hf.get('pretraining_tp')}")

    @staticmethod
    def _refuse(source: str, what: str) -> None:
        raise ConversionError(f"{source}: {what} is not supported by the Megatron model builder; "
                              "convert a model without it or extend megatron_cascade.model first")

    def hf_config(self, model: ModelConfig, template: Optional[dict[str, Any]]) -> dict[str, Any]:
        hf = copy.deepcopy(template) if template else {}
        hf.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            num_hidden_layers=model.num_layers,
            hidden_size=model.hidden_size,
            intermediate_size=model.ffn_hidden_size or 4 * model.hidden_size,
            num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_query_groups or model.num_attention_heads,
            vocab_size=model.vocab_size,
            max_position_embeddings=model.max_position_embeddings,
            rms_norm_eps=model.norm_epsilon,
            tie_word_embeddings=model.tie_embeddings,
            hidden_act="silu",
        )
        head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
        implied = head_dim * model.num_attention_heads == model.hidden_size
        if template is not None and "head_dim" in template and template["head_dim"] is None and implied:
            hf["head_dim"] = None  # the template's "hidden / heads" (Mixtral's config)
        elif template is None or "head_dim" in template or not implied:
            hf["head_dim"] = head_dim
        set_rope_theta(hf, model.rotary_base)
        self._moe_hf_fields(model, hf)
        return hf

    # -- tensor names ----------------------------------------------------------------------------
    def global_names(self, model: ModelConfig) -> dict[str, str]:
        names = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                 "decoder.final_layernorm.weight": "model.norm.weight"}
        if not model.tie_embeddings:
            names["output_layer.weight"] = "lm_head.weight"
        return names

    def layer_names(self, model: ModelConfig, layer: int) -> dict[str, str]:
        """The q/k/v triple of ``linear_qkv`` is interleaved per query group (``convert/tensor_maps.pack_qkv``);
        SwiGLU's ``linear_fc1`` is [gate; up]."""
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        attn = h + "self_attn."
        names = {
            m + "input_layernorm.weight": h + "input_layernorm.weight",
            m + "self_attention.linear_qkv.weight": "+".join(attn + p + ".weight" for p in ("q_proj", "k_proj", "v_proj")),
            m + "self_attention.linear_proj.weight": attn + "o_proj.weight",
            m + "pre_mlp_layernorm.weight": h + "post_attention_layernorm.weight",
        }
        if self.qkv_bias:
            names[m + "self_attention.linear_qkv.bias"] = "+".join(attn + p + ".bias" for p in ("q_proj", "k_proj", "v_proj"))
        if self.qk_norm:
            names[m + "self_attention.q_layernorm.weight"] = attn + "q_norm.weight"
            names[m + "self_attention.k_layernorm.weight"] = attn + "k_norm.weight"
        names.update(self._mlp_names(model, m, h))
        return names

    def _mlp_names(self, model: ModelConfig, m: str, h: str) -> dict[str, str]:
        """The MLP block's names: the dense SwiGLU MLP here; an MoE family's router and experts."""
        return {m + "mlp.linear_fc1.weight": f"{h}mlp.gate_proj.weight+{h}mlp.up_proj.weight",
                m + "mlp.linear_fc2.weight": h + "mlp.down_proj.weight"}

    # -- the MoE block (none here) ------------------------------------------------------------------
    def _moe_config(self, hf: dict[str, Any]) -> Optional[MoEConfig]:
        return None

    def _moe_hf_fields(self, model: ModelConfig, hf: dict[str, Any]) -> None:
        return None

    def check_supported(self, model: ModelConfig) -> None:
        if model.architecture != "gpt":
            raise ConversionError(f"a hybrid (Mamba) model does not map onto {self.architecture}; "
                                  "export it as NemotronHForCausalLM")
        if self.moe != bool(model.moe.num_experts):
            raise ConversionError(f"family {self.name} {'needs' if self.moe else 'cannot have'} MoE layers")
        if model.moe.shared_expert_intermediate_size:
            raise ConversionError("shared experts map onto nemotron_h only (a hybrid model), not onto Llama-style families")
        if model.moe.num_experts and model.moe.layer_freq != 1:
            raise ConversionError("MoE with dense layers in between (moe.layer_freq != 1) is not supported")
        if model.add_bias_linear or model.activation != "swiglu" or model.normalization != "RMSNorm":
            raise ConversionError(
                "only RMSNorm + SwiGLU models without linear biases map onto Llama-style families "
                f"(got normalization={model.normalization}, activation={model.activation}, "
                f"add_bias_linear={model.add_bias_linear})")
        if model.position_embedding_type != "rope" or model.rotary_percent != 1.0:
            raise ConversionError("only full RoPE (position_embedding_type=rope, rotary_percent=1.0) maps onto "
                                  "Llama-style families")


FAMILY = LlamaFamily()
