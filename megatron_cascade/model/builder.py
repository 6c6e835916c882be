"""Build the Megatron-Core model of the ``model`` config section: a ``GPTModel`` (dense or MoE), or with
``model.architecture: hybrid`` a ``MambaModel`` (Mamba-2 / attention / MLP / MoE layer pattern)."""

from __future__ import annotations

import torch

from megatron_cascade.config.model import ConfigError, ModelConfig, ParallelConfig
from megatron_cascade.model.cpu_spec import local_decoder_block_spec
from megatron_cascade.model.hybrid_spec import local_hybrid_stack_spec, te_hybrid_stack_spec
from megatron_cascade.model.moe_aux_loss import with_global_normalized_routers
from megatron_cascade.model.parallel import transformer_engine_available
from megatron_cascade.models.architectures import megatron_architecture

_PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def validate_model_config(model: ModelConfig) -> None:
    """Raise ``ConfigError`` (naming the key) for a model config that cannot be built: the rules the
    ``model`` section declares next to its fields (``config/model.py``), as the loader checks them."""
    from megatron_cascade.config.rules import validate_tree

    validate_tree(model, "model.")


def has_aux_loss(model: ModelConfig) -> bool:
    """Whether the MoE routers of ``model`` add a load-balancing loss in training."""
    moe = model.moe
    return moe.num_experts is not None and moe.router_load_balancing_type != "none" and moe.aux_loss_coeff > 0


def sequence_length_multiple(*, tensor_parallel: int, sequence_parallel: bool, context_parallel: int,
                             fp8: bool) -> int:
    """The multiple every training sequence length is padded to (tokens), the one rule for it.

    Sequence parallel splits the sequence over the TP ranks; context parallel splits it into 2 x CP
    chunks (each rank takes two, for causal load balance); FP8 GEMMs need multiples of 16 rows, asked
    here of every rank's shard (x16 on top of the split), which also makes the whole length one.
    """
    multiple = tensor_parallel if sequence_parallel else 1
    if context_parallel > 1:
        multiple *= 2 * context_parallel
    return multiple * 16 if fp8 else multiple


def _validate_expert_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    etp = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size
    if model.moe.num_experts is not None and parallel.expert_model_parallel_size == 1 \
            and etp != parallel.tensor_model_parallel_size:
        # Megatron-Core 0.16.1 marks expert weights as dense (reduced over the dense data-parallel
        # group) when EP=1, but with ETP < TP they are replicated over TP ranks that see different
        # tokens: their gradients would silently miss the other ranks' share (measured).
        raise ConfigError(
            f"parallel.expert_tensor_parallel_size={etp} differs from parallel.tensor_model_parallel_size="
            f"{parallel.tensor_model_parallel_size} with parallel.expert_model_parallel_size=1: set "
            "expert_model_parallel_size > 1 or expert_tensor_parallel_size = tensor_model_parallel_size"
        )


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2, elementwise (the same values as ``megatron.core.activations.squared_relu``)."""
    return torch.square(torch.nn.functional.relu(x))


def _activation(model: ModelConfig):
    """(activation function, gated) of ``model.activation``."""
    relu2 = squared_relu
    if torch.cuda.is_available():
        # Megatron's is wrapped in torch.compile: a fused kernel on GPU, but on CPU an inductor
        # compile (C++ build) in every process and for every new shape, for one elementwise op.
        from megatron.core.activations import squared_relu as relu2
    return {"swiglu": (torch.nn.functional.silu, True), "gelu": (torch.nn.functional.gelu, False),
            "squared_relu": (relu2, False)}[model.activation]


def params_dtype(model: ModelConfig) -> torch.dtype:
    """The parameter dtype of ``model.precision``."""
    return _PRECISIONS[model.precision]


def transformer_config(model: ModelConfig, parallel: ParallelConfig, *, inference_cuda_graphs: bool = False):
    """The Megatron-Core ``TransformerConfig`` for ``model`` laid out as ``parallel``.

    ``inference_cuda_graphs``: an inference-only model whose layers get megatron-core's local CUDA graph
    managers (``cuda_graph_impl="local"``; a decode copy, ``rollout/cuda_graphs.py``), without activation
    recompute (megatron-core allows full recompute only with whole-iteration graphs; inference needs none)."""
    from megatron.core.transformer import TransformerConfig

    validate_model_config(model)
    _validate_expert_layout(model, parallel)
    architecture = megatron_architecture(model)
    architecture.validate_layout(model, parallel.tensor_model_parallel_size, parallel.context_parallel_size)
    dtype = params_dtype(model)
    use_cpu = not torch.cuda.is_available()
    activation_func, gated = _activation(model)
    kwargs = dict(
        # [] = graphs (when any) capture whole layers: megatron-core's own default "full" says the same
        # and warns at every model build that it is deprecated.
        cuda_graph_scope=[],
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=gated,
        activation_func=activation_func,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std,
        attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=use_cpu,
        perform_initialization=True,
        # Fused kernels need CUDA (and some need apex): on only where they can run.
        bias_activation_fusion=False,
        bias_dropout_fusion=not use_cpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=not use_cpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Our losses divide by the global valid-token count themselves (training/loss_plugin.py). The
        # MoE router reads this flag when it is *built* to scale its aux loss, so it must be set here,
        # not on the config after the model exists.
        calculate_per_token_loss=True,
    )
    kwargs.update(architecture.transformer_config_fields(model))
    if inference_cuda_graphs:
        kwargs.update(cuda_graph_impl="local")
    elif model.recompute != "none":
        kwargs.update(recompute_granularity=model.recompute)
        if model.recompute == "full":
            kwargs.update(recompute_method="uniform", recompute_num_layers=model.recompute_num_layers)
    kwargs.update(_moe_kwargs(model))
    kwargs.update(_fp8_kwargs(model))
    try:
        return TransformerConfig(**kwargs)
    except (AssertionError, ValueError) as exc:
        raise ConfigError(f"Megatron-Core rejected the model config: {exc}") from exc


def _moe_kwargs(model: ModelConfig) -> dict:
    """``TransformerConfig`` fields of ``model.moe`` (none for a dense model)."""
    moe = model.moe
    if moe.num_experts is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        moe_router_pre_softmax=moe.router_pre_softmax,
        moe_router_load_balancing_type=moe.router_load_balancing_type,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_token_dispatcher_type=moe.token_dispatcher_type,
        moe_grouped_gemm=moe.grouped_gemm,
        moe_layer_freq=moe.layer_freq,
        moe_router_score_function=moe.router_score_function,
        moe_router_enable_expert_bias=moe.router_enable_expert_bias,
        moe_router_bias_update_rate=moe.router_bias_update_rate,
        moe_router_topk_scaling_factor=moe.router_topk_scaling_factor,
        moe_router_dtype="fp32",
    )


def _fp8_kwargs(model: ModelConfig) -> dict:
    """``TransformerConfig`` fields of ``model.fp8`` (none with FP8 off); ``ConfigError`` without TE."""
    if model.fp8.format is None:
        return {}
    if not transformer_engine_available():
        raise ConfigError("model.fp8.format is set but Transformer Engine with CUDA is not available")
    return dict(
        fp8=model.fp8.format,
        fp8_recipe=model.fp8.recipe,
        fp8_amax_history_len=model.fp8.amax_history_len,
        fp8_amax_compute_algo=model.fp8.amax_compute_algo,
        fp8_margin=model.fp8.margin,
        fp8_param=model.fp8.param_gather,
    )


def decoder_block_spec(config, normalization: str, pp_rank: int | None = None):
    """The decoder block spec of pipeline stage ``pp_rank`` (None: this rank's in Megatron's parallel
    state): Transformer Engine's when TE and CUDA are there, else the local spec with
    sequence-parallel-capable norms (``model/cpu_spec.py``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if transformer_engine_available():
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization=normalization,
                                          pp_rank=pp_rank)
    return local_decoder_block_spec(config, normalization, pp_rank)


def build_model(model: ModelConfig, parallel: ParallelConfig, *, vp_stage: int | None = None,
                pg_collection=None, inference_cuda_graphs: bool = False):
    """The model ``model.architecture`` names, for this rank's pipeline stage (``BUILDERS``:
    ``GPTModel`` for gpt, ``MambaModel`` for hybrid). Both take the same forward arguments and return [batch, seq, vocab / TP]
    logits, so training, generation and checkpoints treat them alike.

    ``pg_collection``: the process groups of another layout than the training one (a decode copy,
    ``training/decode_copy.py``; ``parallel`` must describe it); None: Megatron's parallel state.
    ``inference_cuda_graphs``: see ``transformer_config``."""
    config = transformer_config(model, parallel, inference_cuda_graphs=inference_cuda_graphs)
    build = BUILDERS[megatron_architecture(model).name]
    return build(model, parallel, vp_stage=vp_stage, pg_collection=pg_collection, config=config)


def _pipeline_end(pg_collection, first: bool) -> bool:
    """Whether this rank holds the first (or last) pipeline stage: of ``pg_collection``'s pipeline,
    else of Megatron's parallel state."""
    from megatron.core import parallel_state

    if pg_collection is None:
        if first:
            return parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    pp = pg_collection.pp
    return pp.rank() == (0 if first else pp.size() - 1)


# Callers written before the hybrid architecture build through this name: it builds what the config names.
build_gpt_model = build_model


def hybrid_stack_spec(config, model: ModelConfig):
    """The ``MambaStack`` spec: megatron-core's Transformer Engine ``mamba_stack_spec`` when TE and
    CUDA are there, else the local one (``model/hybrid_spec.py``)."""
    if transformer_engine_available():
        return te_hybrid_stack_spec(config, model.hybrid)
    return local_hybrid_stack_spec(config, model.hybrid)


def build_hybrid_model(model: ModelConfig, parallel: ParallelConfig, *, vp_stage: int | None = None,
                       pg_collection=None, config=None):
    """A ``MambaModel`` with ``model.hybrid.layer_pattern`` for this rank's pipeline stage (Megatron
    parallel state must be initialised; PP splits the layers evenly, no virtual pipeline).
    The output layer returns vocab-sharded logits of shape [seq, batch, padded_vocab / TP]."""
    from megatron_cascade.model.hybrid_model import hybrid_model_class

    if vp_stage is not None:
        raise ConfigError("model.architecture=hybrid does not support virtual pipeline parallelism "
                          "(Megatron-Core's MambaStack)")
    config = config or transformer_config(model, parallel)
    mamba = hybrid_model_class()(
        config=config,
        mamba_stack_spec=hybrid_stack_spec(config, model),
        vocab_size=model.padded_vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=_pipeline_end(pg_collection, first=True),
        post_process=_pipeline_end(pg_collection, first=False),
        hybrid_override_pattern=model.hybrid.layer_pattern,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding_type,
        rotary_percent=model.rotary_percent,
        rotary_base=int(model.rotary_base),
        pg_collection=pg_collection,
    )
    if not torch.cuda.is_available():
        return mamba
    return mamba.cuda(torch.cuda.current_device())


def _build_gpt(model: ModelConfig, parallel: ParallelConfig, *, vp_stage: int | None = None, pg_collection=None,
               config=None):
    """A ``GPTModel`` for this rank's pipeline stage (Megatron parallel state must be initialised).

    Uses Transformer Engine layer specs when TE and CUDA are available, the local spec otherwise;
    MoE layers get routers whose load-balancing loss follows the global normaliser
    (``model/moe_aux_loss.py``).
    The output layer returns vocab-sharded logits of shape [seq, batch, padded_vocab / TP].
    """
    from megatron.core.models.gpt import GPTModel

    config = config or transformer_config(model, parallel)
    pp_rank = pg_collection.pp.rank() if pg_collection is not None else None
    spec = with_global_normalized_routers(decoder_block_spec(config, model.normalization, pp_rank))
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.padded_vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=_pipeline_end(pg_collection, first=True),
        post_process=_pipeline_end(pg_collection, first=False),
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding_type,
        rotary_percent=model.rotary_percent,
        rotary_base=int(model.rotary_base),
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    if not torch.cuda.is_available():
        return gpt
    return gpt.cuda(torch.cuda.current_device())


# The Megatron-Core model class of each architecture (``models/architectures/``), by its name.
BUILDERS = {"gpt": _build_gpt, "hybrid": build_hybrid_model}
