"""The local (CPU) spec's sequence-parallel norm, the MoE router config keys, and the sequence-padding rule."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megatron_cascade.config import ConfigError, ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.model import transformer_config
from megatron_cascade.model.builder import sequence_length_multiple
from megatron_cascade.model.cpu_spec import SequenceParallelNorm
from megatron_cascade.testing import run_distributed
from megatron_cascade.training import TrainBatch

MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                  moe=MoEConfig(num_experts=4, router_topk=2))


def _moe(**fields):
    return replace(MOE, moe=replace(MOE.moe, **fields))


@pytest.mark.parametrize("model,parallel,message", [
    (_moe(router_enable_expert_bias=True), ParallelConfig(), "router_enable_expert_bias needs model.moe.router_score"),
    (_moe(aux_loss_coeff=0.01), ParallelConfig(), "aux_loss_coeff=0.01 does nothing with"),
    (_moe(router_load_balancing_type="global_aux_loss", aux_loss_coeff=0.01), ParallelConfig(),
     "router_load_balancing_type='global_aux_loss' is not one of"),
    (_moe(router_score_function="relu"), ParallelConfig(), "router_score_function='relu'"),
    (replace(_moe(router_load_balancing_type="seq_aux_loss", aux_loss_coeff=0.01), recompute="full"),
     ParallelConfig(), "model.recompute=full cannot be combined"),
    (MOE, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1),
     "expert_tensor_parallel_size=1 differs from parallel.tensor_model_parallel_size=2 with "
     "parallel.expert_model_parallel_size=1"),
])
def test_bad_router_config(model, parallel, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        transformer_config(model, parallel)


def test_inference_graph_config_drops_recompute_and_leaves_training_alone():
    """A decode copy with CUDA graphs is built with megatron-core's local graph managers and no
    recompute (megatron-core refuses full recompute with per-layer graphs); the training config keeps
    its recompute and no graphs."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, recompute="full")
    copy = transformer_config(model, ParallelConfig(), inference_cuda_graphs=True)
    assert (copy.cuda_graph_impl, copy.recompute_granularity, copy.cuda_graph_scope) == ("local", None, [])
    training = transformer_config(model, ParallelConfig())
    assert (training.cuda_graph_impl, training.recompute_granularity) == ("none", "full")


def test_router_keys_reach_megatron():
    config = transformer_config(_moe(router_score_function="sigmoid", router_enable_expert_bias=True,
                                     router_bias_update_rate=0.01, router_load_balancing_type="seq_aux_loss",
                                     aux_loss_coeff=0.001), ParallelConfig())
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias,
            config.moe_router_bias_update_rate) == ("sigmoid", True, 0.01)
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == ("seq_aux_loss", 0.001)
    assert config.calculate_per_token_loss  # the routers read it when they are built


@pytest.mark.parametrize("tp,sp,cp,fp8,expected", [
    (1, False, 1, False, 1), (2, False, 1, False, 1), (2, True, 1, False, 2), (4, True, 2, False, 16),
    (1, False, 2, False, 4), (2, True, 1, True, 32), (1, False, 1, True, 16),
])
def test_sequence_length_multiple(tp, sp, cp, fp8, expected):
    assert sequence_length_multiple(tensor_parallel=tp, sequence_parallel=sp, context_parallel=cp, fp8=fp8) == expected


def test_sequence_padding_is_outside_the_loss_and_marked_as_padding():
    ids = torch.arange(15).reshape(3, 5)
    batch = TrainBatch(ids, ids + 1, torch.ones(3, 5), advantages=torch.ones(3), ref_logprobs=-torch.ones(3, 5))
    padded = batch.padded_sequences_to_multiple(4).padded_to_multiple(2)
    assert padded.input_ids.shape == (4, 8) and padded.advantages.shape == (4,)
    assert torch.equal(padded.input_ids[:3, :5], ids) and padded.loss_mask[:3, :5].all()
    assert padded.loss_mask.sum() == 15 and padded.ref_logprobs[:, 5:].eq(0).all()
    expected_padding = torch.ones(4, 8, dtype=torch.bool)
    expected_padding[:3, :5] = False
    assert torch.equal(padded.padding_mask, expected_padding)
    assert batch.padded_sequences_to_multiple(5) is batch and batch.padding_mask is None


@pytest.mark.parametrize("normalization,cls", [("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_sequence_parallel_norm_marks_its_weights(normalization, cls, sequence_parallel):
    config = SimpleNamespace(normalization=normalization, sequence_parallel=sequence_parallel,
                             layernorm_zero_centered_gamma=False)
    norm = SequenceParallelNorm(config, 8, eps=1e-5)
    assert isinstance(norm, cls) and norm.eps == 1e-5
    assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())


def _state_dict_keys(model_cfg):
    """Parameter names of our model and of one built from megatron-core's own local spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_cascade.model import build_gpt_model, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=1)
    ours = build_gpt_model(model_cfg, ParallelConfig())
    config = transformer_config(model_cfg, ParallelConfig())
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=model_cfg.normalization)
    theirs = GPTModel(config, spec, vocab_size=model_cfg.padded_vocab_size,
                      max_sequence_length=model_cfg.max_position_embeddings, position_embedding_type="rope",
                      share_embeddings_and_output_weights=model_cfg.tie_embeddings)
    norm_types = (torch.nn.RMSNorm, torch.nn.LayerNorm)
    norms = [name for name, module in ours.named_modules() if isinstance(module, norm_types)]
    unmarked = [name for name, p in ours.named_parameters() if "norm" in name and not hasattr(p, "sequence_parallel")]
    return (sorted(ours.sharded_state_dict().keys()), sorted(theirs.sharded_state_dict().keys()),
            sorted(ours.state_dict().keys()), sorted(theirs.state_dict().keys()), norms, unmarked)


def test_local_spec_keeps_megatron_core_names():
    model_cfg = replace(_moe(layer_freq=2), qk_layernorm=True)  # a dense and an MoE layer, q/k norms
    ours_sharded, theirs_sharded, ours, theirs, norms, unmarked = run_distributed(_state_dict_keys, 1, model_cfg)[0]
    assert ours_sharded == theirs_sharded and ours == theirs
    # 2 layers x (input, pre-MLP, q, k) + the final norm, all ours (marked for the SP grad all-reduce).
    assert len(norms) == 9 and unmarked == []
