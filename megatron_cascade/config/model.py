"""Schema of the ``model`` and ``parallel`` config sections (the single home of their defaults).

Each field carries its valid values (a ``Choice`` enum, or a ``ranged`` / ``checked`` rule);
``validate`` methods hold the rules between fields. ``config.rules.validate_tree`` checks them
when a config is loaded; ``model.builder.validate_model_config`` checks what building needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_cascade.config.rules import Choice, ConfigError, checked, ranged, require

__all__ = [
    "ConfigError", "Architecture", "HybridConfig", "PositionEmbedding", "Normalization", "Activation", "Precision", "Recompute",
    "RouterLoadBalancing", "RouterScoreFunction", "TokenDispatcher", "FP8Format", "FP8Recipe",
    "AmaxComputeAlgo", "MoEConfig", "FP8Config", "ModelConfig", "ParallelConfig",
]


class Architecture(Choice):
    gpt = "gpt"  # Megatron-Core GPTModel: every layer attention + MLP (dense or MoE)
    hybrid = "hybrid"  # Megatron-Core MambaModel: a per-layer pattern of Mamba-2 / attention / MLP / MoE


class PositionEmbedding(Choice):
    rope = "rope"
    learned_absolute = "learned_absolute"
    none = "none"  # no position signal but the causal mixers' own (Nemotron-H: Mamba layers)


class Normalization(Choice):
    RMSNorm = "RMSNorm"
    LayerNorm = "LayerNorm"


class Activation(Choice):
    swiglu = "swiglu"
    gelu = "gelu"
    squared_relu = "squared_relu"  # relu(x)^2, not gated (Nemotron-H)


class Precision(Choice):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Recompute(Choice):
    none = "none"
    selective = "selective"  # the attention core
    full = "full"  # whole layers, in uniform chunks of recompute_num_layers


class RouterLoadBalancing(Choice):
    none = "none"
    aux_loss = "aux_loss"  # per micro-batch
    seq_aux_loss = "seq_aux_loss"  # per sequence: exact for any batch split


class RouterScoreFunction(Choice):
    softmax = "softmax"
    sigmoid = "sigmoid"


class TokenDispatcher(Choice):
    alltoall = "alltoall"
    allgather = "allgather"
    flex = "flex"


class FP8Format(Choice):
    e4m3 = "e4m3"
    hybrid = "hybrid"


class FP8Recipe(Choice):
    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"


class AmaxComputeAlgo(Choice):
    max = "max"
    most_recent = "most_recent"


@dataclass
class MoEConfig:
    """Mixture-of-experts settings; ``num_experts: null`` means a dense model."""

    num_experts: Optional[int] = ranged(None, ge=1)
    router_topk: int = ranged(2, ge=1)  # <= num_experts
    ffn_hidden_size: Optional[int] = ranged(None, ge=1)  # per-expert FFN width; null = model.ffn_hidden_size
    shared_expert_intermediate_size: Optional[int] = ranged(None, ge=1)  # null = no shared expert
    router_pre_softmax: bool = False  # False: softmax over the top-k (normalised top-k probs)
    # Load-balancing loss, weighted like the policy loss (model/moe_aux_loss.py): none (NeMo-RL's GRPO
    # default) | aux_loss (per micro-batch) | seq_aux_loss (per sequence: exact for any batch split),
    # scaled by aux_loss_coeff.
    router_load_balancing_type: RouterLoadBalancing = RouterLoadBalancing.none
    aux_loss_coeff: float = ranged(0.0, ge=0)
    router_score_function: RouterScoreFunction = RouterScoreFunction.softmax
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert routing bias moved by router_bias_update_rate
    # towards equal load after every step, from token counts over the whole global batch. Needs sigmoid.
    router_enable_expert_bias: bool = False
    router_bias_update_rate: float = ranged(1.0e-3, ge=0)
    # Routed experts' weights are multiplied by this (DeepSeek-V3 / Nemotron-H "routed_scaling_factor"); null = 1.
    router_topk_scaling_factor: Optional[float] = ranged(None, gt=0)
    token_dispatcher_type: TokenDispatcher = TokenDispatcher.alltoall
    grouped_gemm: bool = False  # GPU (TE) only
    layer_freq: int = ranged(1, ge=1)  # every k-th layer is MoE

    def validate(self, prefix: str = "model.moe.") -> None:
        """Rules between the MoE fields (``ConfigError`` naming the keys)."""
        if self.num_experts is None:
            return  # a dense model: the router fields are not used
        require(self.router_topk <= self.num_experts, f"{prefix}router_topk={self.router_topk} must be in "
                f"[1, {prefix}num_experts={self.num_experts}]")
        require(not (self.router_load_balancing_type == "none" and self.aux_loss_coeff > 0),
                f"{prefix}aux_loss_coeff={self.aux_loss_coeff} does nothing with {prefix}router_load_balancing_type="
                "'none': set the type (aux_loss | seq_aux_loss) or the coefficient to 0")
        require(not self.router_enable_expert_bias or self.router_score_function == "sigmoid",
                f"{prefix}router_enable_expert_bias needs {prefix}router_score_function=sigmoid "
                "(Megatron-Core's aux-loss-free balancing)")


@dataclass
class FP8Config:
    """Transformer Engine FP8 settings, passed through to ``TransformerConfig`` (GPU only)."""

    format: Optional[FP8Format] = None  # null (off) | e4m3 | hybrid
    recipe: FP8Recipe = FP8Recipe.delayed
    amax_history_len: int = ranged(1024, ge=1)
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.max
    margin: int = ranged(0, ge=0)  # scaling-factor margin, in powers of 2
    param_gather: bool = False  # keep FP8 weight copies (saves memory with the distributed optimizer)


_HYBRID_SYMBOLS = "M*-E"


@dataclass
class HybridConfig:
    """The hybrid (``model.architecture: hybrid``) model's layer pattern and Mamba-2 mixer settings.

    ``layer_pattern`` has one symbol per layer: ``M`` Mamba-2, ``*`` attention, ``-`` dense MLP,
    ``E`` MoE (Megatron-Core's ``hybrid_override_pattern``). Each layer is one of them with its own
    pre-norm and residual (a Nemotron-H "block"), so an attention layer has no MLP of its own.
    """

    layer_pattern: Optional[str] = checked(
        lambda p: len(p) > 0 and set(p) <= set(_HYBRID_SYMBOLS),
        f"must be a non-empty string of the symbols {_HYBRID_SYMBOLS!r} "
        "(M Mamba, * attention, - MLP, E MoE), one per layer")
    mamba_num_heads: Optional[int] = ranged(None, ge=1)  # SSM heads; null = 2 * hidden_size / mamba_head_dim
    mamba_head_dim: int = ranged(64, ge=1)  # channels per SSM head
    mamba_state_dim: int = ranged(128, ge=1)  # SSM state size per head (d_state)
    mamba_num_groups: int = ranged(8, ge=1)  # B/C groups shared by heads; bounds the TP size
    mamba_conv_kernel: int = ranged(4, ge=2)  # causal depthwise conv width (tokens)
    mamba_chunk_size: int = ranged(128, ge=1)  # SSD scan chunk (tokens): speed only, same result

    def num_heads(self, hidden_size: int) -> int:
        """SSM heads: ``mamba_num_heads``, else Megatron's default ``2 * hidden_size / mamba_head_dim``."""
        return self.mamba_num_heads or 2 * hidden_size // self.mamba_head_dim


@dataclass
class ModelConfig:
    """A GPTModel (dense or MoE; RoPE, GQA, SwiGLU, RMSNorm by default), or with
    ``architecture: hybrid`` a Mamba-2 / attention / MoE MambaModel (``hybrid`` section)."""

    architecture: Architecture = Architecture.gpt
    num_layers: int = ranged(2, ge=1)
    hidden_size: int = ranged(64, ge=1)
    ffn_hidden_size: Optional[int] = ranged(None, ge=1)  # null = 4 * hidden_size (dense MLP width)
    num_attention_heads: int = ranged(4, ge=1)
    num_query_groups: Optional[int] = ranged(None, ge=1)  # GQA key/value heads; null = num_attention_heads
    kv_channels: Optional[int] = ranged(None, ge=1)  # head dim; null = hidden_size / num_attention_heads
    vocab_size: int = ranged(256, ge=1)  # tokenizer vocabulary (before padding)
    make_vocab_size_divisible_by: int = ranged(128, ge=1)  # embedding rows are padded to a multiple of this
    max_position_embeddings: int = ranged(4096, ge=2)  # tokens: prompt + response must fit
    position_embedding_type: PositionEmbedding = PositionEmbedding.rope
    rotary_base: float = ranged(10000.0, gt=0)
    rotary_percent: float = ranged(1.0, gt=0, le=1)  # share of the head dim rotated
    normalization: Normalization = Normalization.RMSNorm
    norm_epsilon: float = ranged(1e-6, gt=0)
    activation: Activation = Activation.swiglu
    add_bias_linear: bool = False
    add_qkv_bias: bool = False  # Qwen2.5
    qk_layernorm: bool = False  # Qwen3
    tie_embeddings: bool = False  # share input embedding and output layer weights
    init_method_std: float = ranged(0.02, gt=0)
    attention_dropout: float = ranged(0.0, ge=0, lt=1)  # a probability
    hidden_dropout: float = ranged(0.0, ge=0, lt=1)
    precision: Precision = Precision.fp32
    # Activation recompute in training: none | selective (attention core) | full (whole layers, in
    # uniform chunks of recompute_num_layers). Trades compute for activation memory (the dry-run plan counts it).
    recompute: Recompute = Recompute.none
    recompute_num_layers: int = ranged(1, ge=1)
    moe: MoEConfig = field(default_factory=MoEConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    hybrid: HybridConfig = field(default_factory=HybridConfig)

    @property
    def padded_vocab_size(self) -> int:
        div = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // div) * div

    def validate(self, prefix: str = "model.") -> None:
        """Rules between the model fields (``ConfigError`` naming the keys)."""
        require(self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
                f"{prefix}num_attention_heads={self.num_attention_heads} does not divide {prefix}hidden_size="
                f"{self.hidden_size}; set {prefix}kv_channels (head dim) explicitly")
        groups = self.num_query_groups or self.num_attention_heads
        require(self.num_attention_heads % groups == 0, f"{prefix}num_query_groups={groups} does not divide "
                f"{prefix}num_attention_heads={self.num_attention_heads}")
        head_dim = self.kv_channels or self.hidden_size // self.num_attention_heads
        require(self.position_embedding_type != "rope" or head_dim % 2 == 0,
                f"RoPE needs an even head dim, got {head_dim} ({prefix}kv_channels)")
        require(self.fp8.format is None or self.precision == "bf16",
                f"{prefix}fp8.format needs {prefix}precision=bf16 (FP8 GEMMs with bf16 master compute)")
        aux_loss = self.moe.num_experts is not None and self.moe.router_load_balancing_type != "none" \
            and self.moe.aux_loss_coeff > 0
        # The recomputed router forward runs in the backward pass, after the training step's
        # per-sequence aux-loss weights (model/moe_aux_loss.py) are gone.
        require(not (aux_loss and self.recompute == "full"),
                f"{prefix}recompute=full cannot be combined with an MoE load-balancing loss "
                f"({prefix}moe.router_load_balancing_type / aux_loss_coeff): use recompute=selective "
                "or router_load_balancing_type=none")
        if self.architecture == "hybrid":
            self._validate_hybrid(prefix)
        else:
            require(self.hybrid.layer_pattern is None,
                    f"{prefix}hybrid.layer_pattern is set but {prefix}architecture={self.architecture!r}: "
                    f"set {prefix}architecture=hybrid or remove the pattern")

    def _validate_hybrid(self, prefix: str) -> None:
        """Rules of the hybrid architecture (layer pattern vs layers and experts, Mamba head layout)."""
        hybrid, pattern = self.hybrid, self.hybrid.layer_pattern
        require(pattern is not None, f"{prefix}architecture=hybrid needs {prefix}hybrid.layer_pattern "
                "(one of M * - E per layer, e.g. 'M*ME')")
        require(len(pattern) == self.num_layers, f"{prefix}hybrid.layer_pattern={pattern!r} has {len(pattern)} "
                f"symbols but {prefix}num_layers={self.num_layers}: one symbol per layer")
        has_moe = "E" in pattern
        require(has_moe == (self.moe.num_experts is not None),
                f"{prefix}hybrid.layer_pattern={pattern!r} " + ("has MoE layers (E) but "
                f"{prefix}moe.num_experts is null" if has_moe else f"has no MoE layer (E) but "
                f"{prefix}moe.num_experts={self.moe.num_experts}: add E layers or set num_experts to null"))
        require(self.moe.layer_freq == 1, f"{prefix}moe.layer_freq={self.moe.layer_freq} has no meaning with "
                f"{prefix}architecture=hybrid: the layer pattern places the MoE layers (E)")
        require(self.fp8.format is None or "M" not in pattern or self._mamba_in_proj_width() % 16 == 0,
                f"{prefix}fp8.format needs the Mamba in_proj width 2*heads*head_dim + 2*groups*state_dim + heads "
                f"= {self._mamba_in_proj_width()} to be a multiple of 16 ({prefix}hybrid.*)")
        heads = hybrid.num_heads(self.hidden_size)
        require(heads >= 1, f"{prefix}hybrid.mamba_head_dim={hybrid.mamba_head_dim} is larger than "
                f"2 * {prefix}hidden_size: set {prefix}hybrid.mamba_num_heads")
        require(heads % hybrid.mamba_num_groups == 0, f"{prefix}hybrid.mamba_num_groups={hybrid.mamba_num_groups} "
                f"does not divide the Mamba heads ({heads}, {prefix}hybrid.mamba_num_heads)")

    def _mamba_in_proj_width(self) -> int:
        h = self.hybrid
        heads = h.num_heads(self.hidden_size)
        return 2 * heads * h.mamba_head_dim + 2 * h.mamba_num_groups * h.mamba_state_dim + heads


@dataclass
class ParallelConfig:
    """Parallel layout; data-parallel size is what is left of the world size."""

    tensor_model_parallel_size: int = ranged(1, ge=1)
    pipeline_model_parallel_size: int = ranged(1, ge=1)
    expert_model_parallel_size: int = ranged(1, ge=1)
    expert_tensor_parallel_size: Optional[int] = ranged(None, ge=1)  # null = tensor_model_parallel_size
    context_parallel_size: int = ranged(1, ge=1)
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False


@dataclass
class DecodeParallelConfig:
    """``rollout.parallel``: the layout of an inference-only copy of the policy that generates the
    rollouts (``training/decode_copy.py``), refit from the training model in memory after every
    optimizer step. No context parallelism; pipeline stages only where the weights need them (they
    decode in series); data parallelism is what the world size leaves. Unset (null): generation runs
    on the training model, at the training layout."""

    tensor_model_parallel_size: int = ranged(1, ge=1)
    pipeline_model_parallel_size: int = ranged(1, ge=1)  # > 1 only for weights too large for TP x EP alone
    expert_model_parallel_size: int = ranged(1, ge=1)
    expert_tensor_parallel_size: Optional[int] = ranged(None, ge=1)  # null = tensor_model_parallel_size

    def as_parallel(self) -> ParallelConfig:
        """The ``ParallelConfig`` the decode copy is built with. Sequence parallelism is on with TP > 1
        only because Megatron refuses MoE + TP without it in the model config; generation runs with
        it off (``rollout/stage_forward.sequence_parallel_off``)."""
        tp = self.tensor_model_parallel_size
        return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=self.pipeline_model_parallel_size,
                              expert_model_parallel_size=self.expert_model_parallel_size,
                              expert_tensor_parallel_size=self.expert_tensor_parallel_size, sequence_parallel=tp > 1)
