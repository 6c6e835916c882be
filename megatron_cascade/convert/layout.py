"""Check a TP/PP/EP layout against a model config (no processes are started)."""

from __future__ import annotations

from megatron_cascade.config.model import ConfigError, ModelConfig
from megatron_cascade.models.architectures import megatron_architecture
from megatron_cascade.models.errors import ConversionError


def validate_layout(model: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """Raise ``ConversionError`` if ``model`` cannot be laid out at tensor ``tp``, pipeline ``pp``, expert ``ep``.

    Distributed checkpoints are layout-independent, so this only checks divisibility: heads, query
    groups and padded vocab by ``tp``, layers by ``pp``, experts by ``ep``.
    """
    for flag, size in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if size < 1:
            raise ConversionError(f"{flag}={size} must be >= 1")
    groups = model.num_query_groups or model.num_attention_heads
    checks = [
        ("--tp", tp, "num_attention_heads", model.num_attention_heads),
        ("--tp", tp, "padded vocab size", model.padded_vocab_size),
        ("--pp", pp, "num_layers", model.num_layers),
    ]
    architecture = megatron_architecture(model)
    try:
        architecture.validate_layout(model, tp, 1)
    except ConfigError as exc:
        raise ConversionError(f"--tp={tp}: {exc}") from None
    if not architecture.kv_heads_replicate:
        checks.insert(1, ("--tp", tp, "num_query_groups (key/value heads)", groups))
    elif groups % tp and tp % groups:
        raise ConversionError(f"--tp={tp} is neither a divisor nor a multiple of the model's num_query_groups "
                              f"(key/value heads)={groups}; pick another --tp")
    if ep > 1 and not model.moe.num_experts:
        raise ConversionError(f"--ep={ep} needs an MoE model; this model is dense (use --ep 1)")
    if model.moe.num_experts:
        checks.append(("--ep", ep, "num_experts", model.moe.num_experts))
    for flag, size, what, value in checks:
        if value % size:
            raise ConversionError(f"{flag}={size} does not divide the model's {what}={value}; pick another {flag}")

