"""Bad model and parallel configs give one clear error each, before any process group exists."""

from dataclasses import replace

import pytest

from megatron_cascade.config import ConfigError, FP8Config, ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.model import resolve_layout, transformer_config, validate_model_config

BASE = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=200)
MOE = replace(BASE, moe=MoEConfig(num_experts=4))


@pytest.mark.parametrize("model,parallel,world,message", [
    (BASE, ParallelConfig(tensor_model_parallel_size=3), 3,
     "tensor_model_parallel_size=3 does not divide model.num_attention_heads=4"),
    (replace(BASE, num_attention_heads=8, num_query_groups=2), ParallelConfig(tensor_model_parallel_size=4), 4,
     "tensor_model_parallel_size=4 does not divide model.num_query_groups=2"),
    (BASE, ParallelConfig(pipeline_model_parallel_size=3), 3,
     "pipeline_model_parallel_size=3 does not divide model.num_layers=4"),
    (BASE, ParallelConfig(tensor_model_parallel_size=2), 3, "world size 3 is not divisible"),
    (BASE, ParallelConfig(expert_model_parallel_size=2), 2, "needs an MoE model"),
    (MOE, ParallelConfig(expert_model_parallel_size=3), 3, "expert_model_parallel_size=3 does not divide"),
    (MOE, ParallelConfig(tensor_model_parallel_size=2), 2, "needs parallel.sequence_parallel=true"),
    (BASE, ParallelConfig(sequence_parallel=True), 1, "sequence_parallel=true needs"),
    (BASE, ParallelConfig(overlap_param_gather=True), 1, "overlap_param_gather=true needs parallel.use_distributed"),
    (BASE, ParallelConfig(tensor_model_parallel_size=0), 1, "must be >= 1"),
    (replace(BASE, make_vocab_size_divisible_by=1, vocab_size=201), ParallelConfig(tensor_model_parallel_size=2),
     2, "does not divide padded vocab size=201"),
])
def test_bad_parallel_config(model, parallel, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_layout(model, parallel, world)


def test_good_layout_resolves_data_parallel_size():
    layout = resolve_layout(MOE, ParallelConfig(expert_model_parallel_size=2, pipeline_model_parallel_size=2), 8)
    assert (layout.tp, layout.pp, layout.ep, layout.dp, layout.expert_dp) == (1, 2, 2, 4, 2)


@pytest.mark.parametrize("model,message", [
    (replace(BASE, hidden_size=66), "num_attention_heads=4 does not divide model.hidden_size=66"),
    (replace(BASE, num_query_groups=3), "num_query_groups=3 does not divide"),
    (replace(BASE, normalization="BatchNorm"), "model.normalization='BatchNorm' is not one of"),
    (replace(BASE, activation="relu6"), "model.activation='relu6' is not one of"),
    (replace(BASE, precision="fp64"), "model.precision='fp64'"),
    (replace(BASE, moe=MoEConfig(num_experts=4, router_topk=5)), "router_topk=5 must be in"),
    (replace(BASE, moe=MoEConfig(num_experts=4, token_dispatcher_type="ring")), "token_dispatcher_type='ring'"),
    (replace(BASE, fp8=FP8Config(format="e5m2")), "model.fp8.format='e5m2'"),
    (replace(BASE, fp8=FP8Config(format="hybrid", recipe="magic")), "model.fp8.recipe='magic'"),
    (replace(BASE, fp8=FP8Config(format="hybrid")), "needs model.precision=bf16"),
    (replace(BASE, precision="fp16", fp8=FP8Config(format="hybrid")), "needs model.precision=bf16"),
    (replace(BASE, kv_channels=15), "even head dim"),
])
def test_bad_model_config(model, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_model_config(model)


def test_fp8_without_transformer_engine_is_refused():
    model = replace(BASE, precision="bf16", fp8=FP8Config(format="hybrid", recipe="delayed", amax_history_len=16))
    validate_model_config(model)  # a valid FP8 config ...
    with pytest.raises(ConfigError, match="Transformer Engine"):
        transformer_config(model, ParallelConfig())  # ... that this CPU machine cannot run


def test_transformer_config_passes_architecture_through():
    cfg = transformer_config(replace(MOE, qk_layernorm=True, kv_channels=32), ParallelConfig())
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_query_groups, cfg.kv_channels) == (4, 64, 2, 32)
    assert cfg.gated_linear_unit and cfg.normalization == "RMSNorm" and cfg.qk_layernorm
    assert (cfg.num_moe_experts, cfg.moe_router_topk) == (4, 2)
