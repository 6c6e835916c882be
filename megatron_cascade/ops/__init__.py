"""Tensor-parallel aware token-level ops on vocab-sharded logits."""

from megatron_cascade.ops.fused_output_logprobs import fused_output_logprobs
from megatron_cascade.ops.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_cascade.ops.truncated_logprobs import vocab_parallel_truncated_logprobs

__all__ = ["vocab_parallel_logprobs", "vocab_parallel_entropy", "vocab_parallel_truncated_logprobs",
           "fused_output_logprobs"]
