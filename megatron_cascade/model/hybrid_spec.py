"""Layer specs of the hybrid Mamba-2 / attention / MLP / MoE model (Megatron-Core ``MambaModel``).

On GPU (Transformer Engine) the spec is megatron-core's ``mamba_stack_spec`` with the MoE layer's
experts built for this config. Without TE (CPU) it is assembled here from the same module classes
with local linears (``ColumnParallelLinear`` / ``RowParallelLinear``), the local core attention that
also takes packed (THD) rows (``model/cpu_spec.local_packed_attention``), the non-TE MoE spec and
``SequenceParallelNorm`` (``model/cpu_spec.py``) for every norm.

Checkpoint names: TE fuses a layer's pre-norm into the next linear (``mixer.in_proj.layer_norm_weight``,
``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``) and keeps the MoE
layer's ``pre_mlp_layernorm`` separate. The CPU spec's separate norms carry a
``sharded_state_dict_keys_map`` that saves them under those TE names, so a checkpoint written on CPU
loads into the TE model and back (the same rule as the GPT specs, ``model/spec_layout.py``).
"""

from __future__ import annotations

from megatron_cascade.model.cpu_spec import SequenceParallelNorm, local_packed_attention

_MIXER_NORM_AS_TE = {"norm.": "mixer.in_proj.layer_norm_"}
_ATTENTION_NORM_AS_TE = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
_MLP_NORM_AS_TE = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _mixer_params(config_hybrid) -> dict:
    """``MambaMixer`` constructor arguments that ``TransformerConfig`` does not carry."""
    return {"d_conv": config_hybrid.mamba_conv_kernel, "chunk_size": config_hybrid.mamba_chunk_size}


def _moe_spec(config, use_te: bool):
    """The MoE block spec, with the router whose load-balancing loss follows the global normaliser
    (``model/moe_aux_loss.py``, as in the GPT specs)."""
    from dataclasses import replace

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_cascade.model.moe_aux_loss import global_normalized_router

    spec = get_moe_module_spec(use_te=use_te, num_experts=config.num_moe_experts,
                               moe_grouped_gemm=config.moe_grouped_gemm if use_te else False)
    return replace(spec, submodules=replace(spec.submodules, router=global_normalized_router()))


def local_hybrid_stack_spec(config, hybrid):
    """The ``MambaStack`` spec without Transformer Engine (CPU). ``hybrid``: the ``model.hybrid`` section."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=SequenceParallelNorm,
        mixer=ModuleSpec(module=MambaMixer, params=_mixer_params(hybrid), submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=_MIXER_NORM_AS_TE))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=SequenceParallelNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=ColumnParallelLinear, core_attention=local_packed_attention(),
                                      linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=_ATTENTION_NORM_AS_TE))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=SequenceParallelNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=_MLP_NORM_AS_TE))
    moe = None
    if config.num_moe_experts is not None:
        moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=SequenceParallelNorm, mlp=_moe_spec(config, use_te=False),
            mlp_bda=get_bias_dropout_add))
    submodules = MambaStackSubmodules(mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp)
    if moe is not None:
        submodules.moe_layer = moe
    return ModuleSpec(module=MambaStack, submodules=submodules)


def te_hybrid_stack_spec(config, hybrid):
    """megatron-core's Transformer Engine ``mamba_stack_spec`` with this config's mixer settings and
    MoE experts (its module-level MoE spec is built for a fixed example expert count)."""
    from dataclasses import replace

    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    stack = mamba_stack_spec.submodules
    mamba_layer = stack.mamba_layer
    mixer = replace(mamba_layer.submodules.mixer, params={**mamba_layer.submodules.mixer.params,
                                                          **_mixer_params(hybrid)})
    mamba_layer = replace(mamba_layer, submodules=replace(mamba_layer.submodules, mixer=mixer))
    submodules = replace(stack, mamba_layer=mamba_layer)
    if config.num_moe_experts is not None:
        moe_layer = replace(stack.moe_layer, submodules=replace(stack.moe_layer.submodules,
                                                                mlp=_moe_spec(config, use_te=True)))
        submodules = replace(submodules, moe_layer=moe_layer)
    return replace(mamba_stack_spec, submodules=submodules)
