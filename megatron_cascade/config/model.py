"""Schema of the ``model`` and ``parallel`` config sections (the single home of their defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    """A configuration a user wrote cannot work; the message names the key and what to do."""


@dataclass
class MoEConfig:
    """Mixture-of-experts settings; ``num_experts: null`` means a dense model."""

    num_experts: Optional[int] = None
    router_topk: int = 2
    ffn_hidden_size: Optional[int] = None  # per-expert FFN width; null = model.ffn_hidden_size
    shared_expert_intermediate_size: Optional[int] = None  # null = no shared expert
    router_pre_softmax: bool = False  # False: softmax over the top-k (normalised top-k probs)
    # Load-balancing loss, weighted like the policy loss (model/moe_aux_loss.py): none (NeMo-RL's GRPO
    # default) | aux_loss (per micro-batch) | seq_aux_loss (per sequence: exact for any batch split),
    # scaled by aux_loss_coeff.
    router_load_balancing_type: str = "none"
    aux_loss_coeff: float = 0.0
    router_score_function: str = "softmax"  # softmax | sigmoid
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert routing bias moved by router_bias_update_rate
    # towards equal load after every step, from token counts over the whole global batch. Needs sigmoid.
    router_enable_expert_bias: bool = False
    router_bias_update_rate: float = 1.0e-3
    token_dispatcher_type: str = "alltoall"  # alltoall | allgather | flex
    grouped_gemm: bool = False  # GPU (TE) only
    layer_freq: int = 1  # every k-th layer is MoE


@dataclass
class FP8Config:
    """Transformer Engine FP8 settings, passed through to ``TransformerConfig`` (GPU only)."""

    format: Optional[str] = None  # null (off) | e4m3 | hybrid
    recipe: str = "delayed"  # delayed | tensorwise | mxfp8 | blockwise
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"  # max | most_recent
    margin: int = 0
    param_gather: bool = False  # keep FP8 weight copies (saves memory with the distributed optimizer)


@dataclass
class ModelConfig:
    """A GPTModel: dense or MoE, RoPE, GQA, SwiGLU, RMSNorm by default."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: Optional[int] = None  # null = 4 * hidden_size (dense MLP width)
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # GQA key/value heads; null = num_attention_heads
    kv_channels: Optional[int] = None  # head dim; null = hidden_size / num_attention_heads
    vocab_size: int = 256  # tokenizer vocabulary (before padding)
    make_vocab_size_divisible_by: int = 128  # embedding rows are padded to a multiple of this
    max_position_embeddings: int = 4096
    position_embedding_type: str = "rope"  # rope | learned_absolute
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    normalization: str = "RMSNorm"  # RMSNorm | LayerNorm
    norm_epsilon: float = 1e-6
    activation: str = "swiglu"  # swiglu | gelu
    add_bias_linear: bool = False
    add_qkv_bias: bool = False  # Qwen2.5
    qk_layernorm: bool = False  # Qwen3
    tie_embeddings: bool = False  # share input embedding and output layer weights
    init_method_std: float = 0.02
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    precision: str = "fp32"  # fp32 | bf16 | fp16
    # Activation recompute in training: none | selective (attention core) | full (whole layers, in
    # uniform chunks of recompute_num_layers). Trades compute for activation memory (the dry-run plan counts it).
    recompute: str = "none"
    recompute_num_layers: int = 1
    moe: MoEConfig = field(default_factory=MoEConfig)
    fp8: FP8Config = field(default_factory=FP8Config)

    @property
    def padded_vocab_size(self) -> int:
        div = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // div) * div


@dataclass
class ParallelConfig:
    """Parallel layout; data-parallel size is what is left of the world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # null = tensor_model_parallel_size
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
