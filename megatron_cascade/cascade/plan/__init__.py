"""``run --dry-run``: refuse what the code cannot run, then print the layout, the per-GPU memory plan
and the stage plan, for the cluster the config describes (no GPU touched, no CUDA/TE needed here).

One module per part: ``params`` (parameters, static state), ``checks`` (what cannot run),
``activations`` (training), ``generation`` (the paged KV cache), ``stage_memory`` (one stage),
``describe`` (the text).

Memory model (bytes per GPU, the most loaded pipeline stage, per stage of the cascade):

* static: weights, gradients, optimizer state (``memory_per_gpu``), plus the frozen KL reference
  (GRPO with ``loss.kl_coef > 0``) or the one resident MOPD teacher, in the model dtype;
* generation (``rollout/engine.py``): the paged KV cache — ``rollout.kv_cache_bytes`` or
  ``kv_cache_fraction`` of the memory the static state and frozen models leave, at most what every
  local sample needs at its longest — plus one generation step (the largest layer intermediates of
  up to max(16K, the longest sample) tokens and the sampled rows' logits); blocks are taken on
  demand, so the samples decoding at once are counted at ``rollout.expected_response_fraction`` of
  ``max_new_tokens`` (per GPU: over the TP x PP x CP GPUs of a model replica); a budget that cannot
  hold one sample at its longest is refused;
* training: activations of the micro-batches in flight (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", generalised to GQA, SwiGLU and MoE top-k;
  with ``model.recompute`` none/selective/full) and the output head: where the stage samples from a
  top-k / top-p truncated distribution the [tokens, V/t] logits with their gradient (model dtype: the
  fp32 work of ``ops/truncated_logprobs.py`` is chunked, and Float16Module's fp32 copy is disabled),
  else the fused log-prob head's working set (``training/output_head.py``: per-chunk logit buffers,
  the gathered hidden states and their gradient; no [tokens, vocab] tensor); with expert
  parallelism the routed experts' tensors are those of the most loaded EP rank
  (``cluster.moe_load_imbalance`` x the mean);
* peak = static + max(generation, training) + ``cluster.runtime_overhead_gib`` (CUDA context, NCCL,
  workspaces); host memory holds the offloaded MOPD teachers.

Every model is counted block by block of its layers (``models/architectures/``: a GPT layer is
attention + a dense MLP or MoE, a hybrid layer one Mamba-2, attention, MLP or MoE block): parameters,
activations (under ``recompute: full`` each chunk's input is kept and the largest chunk's layers
are recomputed at once), KV per attention block and, in generation, one conv + SSM state slot per
sample for the Mamba blocks, in the same paged engine.
"""

from megatron_cascade.cascade.plan.activations import (
    Shape, block_activation_bytes, fused_head_bytes, layer_activation_bytes, logits_bytes, mamba_block_bytes,
    routed_load, samples_truncated, training_activation_bytes,
)
from megatron_cascade.cascade.plan.checks import (
    check_decode_layout, check_generation_layouts, check_runnable, decode_copy_bytes, uses_cuda_graphs,
)
from megatron_cascade.cascade.plan.describe import describe_plan
from megatron_cascade.cascade.plan.generation import (
    GenerationPlan, generation_plan, kv_bytes_per_token, mamba_state_bytes_per_sample, prefill_bytes,
)
from megatron_cascade.cascade.plan.params import GIB, ParamCount, count_parameters, memory_per_gpu, params_per_gpu
from megatron_cascade.cascade.plan.stage_memory import StageMemory, stage_memory

__all__ = [
    "GIB", "GenerationPlan", "ParamCount", "Shape", "StageMemory", "block_activation_bytes", "check_decode_layout",
    "check_generation_layouts", "check_runnable", "count_parameters", "decode_copy_bytes", "describe_plan",
    "fused_head_bytes", "generation_plan", "kv_bytes_per_token", "layer_activation_bytes", "logits_bytes",
    "mamba_block_bytes", "mamba_state_bytes_per_sample", "memory_per_gpu", "params_per_gpu", "prefill_bytes",
    "routed_load", "samples_truncated", "stage_memory", "training_activation_bytes", "uses_cuda_graphs",
]
