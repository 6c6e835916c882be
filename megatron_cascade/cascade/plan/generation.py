"""Generation memory: a prefill step's intermediates, KV and Mamba state per sample, the paged cache's budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_cascade.cascade.plan.activations import Shape, routed_load
from megatron_cascade.cascade.plan.params import DTYPE_BYTES, GIB, head_dim, mamba_sizes, stage_layers
from megatron_cascade.config import ConfigError, RunConfig
from megatron_cascade.config.model import ModelConfig
from megatron_cascade.config.schema import ResolvedStage
from megatron_cascade.model import Layout
from megatron_cascade.models.architectures import ATTENTION, MAMBA, count_blocks, megatron_architecture


def prefill_bytes(m: ModelConfig, layout: Layout, shape: Shape, *, fused_attention: bool) -> float:
    """Largest set of live tensors while one layer runs the prompt forward (no grad, nothing kept):
    the residual and norm output plus the attention block's or the MLP/experts' intermediates."""
    e, t = DTYPE_BYTES[m.precision], layout.tp
    tokens = shape.seq * shape.batch
    h, a, d = m.hidden_size, m.num_attention_heads, head_dim(m)
    g = m.num_query_groups or a
    gate = 2 if m.activation == "swiglu" else 1
    attention = tokens * d * (2 * a + 2 * g) / t  # Q, K, V and the core-attention output
    if not fused_attention:
        attention += shape.batch * (a / t) * shape.seq**2  # the [s x s] scores of unfused attention
    if m.moe.num_experts:
        e_ffn = m.moe.ffn_hidden_size or m.ffn_hidden_size or 4 * h
        routed = tokens * m.moe.router_topk * shape.routed_load
        mlp = routed * (h + e_ffn * (gate + 1) / layout.etp)
    else:
        mlp = tokens * (m.ffn_hidden_size or 4 * h) * (gate + 1) / t
    return e * (2 * tokens * h + max(attention, mlp))


def kv_bytes_per_token(m: ModelConfig, layout: Layout) -> float:
    """K and V of one token in every attention layer of the most loaded pipeline stage, this rank's KV heads."""
    groups = m.num_query_groups or m.num_attention_heads
    layers = count_blocks(stage_layers(m, layout), ATTENTION)
    return 2 * layers * max(groups // layout.tp, 1) * head_dim(m) * DTYPE_BYTES[m.precision]


def mamba_state_bytes_per_sample(m: ModelConfig, layout: Layout) -> float:
    """One sample's generation state in the Mamba layers of the most loaded stage: the conv state
    [conv channels / t, kernel] and the SSM state [heads / t, head dim, state] per layer (model dtype)."""
    layers = count_blocks(stage_layers(m, layout), MAMBA)
    if not layers:
        return 0.0
    heads, _, conv, _ = mamba_sizes(m)
    hy = m.hybrid
    per_layer = conv * hy.mamba_conv_kernel + heads * hy.mamba_head_dim * hy.mamba_state_dim
    return layers * per_layer / layout.tp * DTYPE_BYTES[m.precision]


@dataclass(frozen=True)
class GenerationPlan:
    """The paged generator's memory and concurrency on one GPU (``rollout/engine.py``), bytes.

    KV blocks are taken on demand: a sample holds the blocks of its tokens so far (plus, for a hybrid
    model, one conv + SSM state slot), so how many decode at once depends on how long responses
    get; the plan takes them at ``rollout.expected_response_fraction`` of ``max_new_tokens``. The
    ``samples_per_prompt`` samples of a prompt share its full blocks (``rollout/block_allocator.py``):
    a sample's figures count its share of them.
    """

    kv_cache: float  # KV blocks (at most every local sample at its longest, + the dummy) + Mamba state slots
    step: float  # one forward step: its largest layer intermediates and the sampled rows' logits
    concurrent: int  # local samples decoding at once, at their expected length
    samples: int  # local samples of a step (one model replica's)
    gpus: int  # GPUs of one model replica (TP x PP x CP): they decode its samples together
    expected_kv: float  # one sample's KV blocks at its expected length (its share of the prompt's)
    worst_kv: float  # ... at its longest (prompt + max_new_tokens)
    state: float  # one sample's Mamba state slot (hybrid models; 0 otherwise)
    capacity: int  # samples the cache holds at once at their expected length (whatever a step has)
    stages_in_series: int = 1  # pipeline stages that decode one after another (the training layout's PP)
    group: int = 1  # samples per prompt: they share the prompt's full blocks

    @property
    def prompt_sharing(self) -> str:
        return f" (prompt shared by {self.group})" if self.group > 1 else ""

    @property
    def concurrent_per_gpu(self) -> float:
        return self.concurrent / self.gpus

    @property
    def capacity_per_gpu(self) -> float:
        return self.capacity / self.gpus


def generation_plan(cfg: RunConfig, layout: Layout, stage: ResolvedStage, free_bytes: float) -> GenerationPlan:
    """What the paged generator allocates for ``stage`` (``rollout/kv_budget.cache_capacity``): the
    budget is ``rollout.kv_cache_bytes`` (or ``kv_cache_fraction`` of ``free_bytes``, the memory left
    by weights, optimizer and frozen models); a hybrid model first takes a state slot for as many
    samples as fit at their expected length, the rest are KV blocks, at most what every local sample
    needs at its longest. A step runs at most max(16384, the longest sample + the live requests)
    tokens (a preempted sample is prefilled again from prompt + response) through flash attention
    (no [s x s] scores) and the output layer on each request's last token.

    Raises ``ConfigError`` when the budget cannot hold one sample at its longest (generation would
    refuse to start).
    """
    m, r = cfg.model, stage.rollout
    samples = stage.prompts_per_step * stage.samples_per_prompt // layout.dp
    prompt = min(cfg.data.max_prompt_tokens, m.max_position_embeddings)
    longest = min(prompt + r.max_new_tokens, m.max_position_embeddings)
    expected_len = min(prompt + math.ceil(r.expected_response_fraction * r.max_new_tokens), longest)
    block = r.kv_block_size_tokens * kv_bytes_per_token(m, layout)
    group = stage.samples_per_prompt
    shared = prompt // r.kv_block_size_tokens if group > 1 else 0  # the prompt's full blocks, held once per group

    def per_sample(tokens: int) -> float:  # blocks of one sample of ``tokens`` tokens, its share of the prompt's
        return (math.ceil(tokens / r.kv_block_size_tokens) - shared + shared / group) * block

    worst, expected = per_sample(longest), per_sample(expected_len)
    alone = math.ceil(longest / r.kv_block_size_tokens) * block  # a sample without its group (e.g. preempted)
    state = mamba_state_bytes_per_sample(m, layout)
    budget = r.kv_cache_bytes if r.kv_cache_bytes is not None else r.kv_cache_fraction * free_bytes
    one = alone + block + state  # one sample at its longest, its state slot and Megatron's dummy block
    if budget < one and r.kv_cache_bytes is None and free_bytes <= 0:
        budget = one  # the static state alone overflows (the plan warns): plan one sample
    if budget < one:
        key = "rollout.kv_cache_bytes" if r.kv_cache_bytes is not None else "rollout.kv_cache_fraction"
        with_state = f" + {state / GIB:.2f} GiB of Mamba state" if state else ""
        raise ConfigError(f"stage {stage.name}: the KV cache budget ({budget / GIB:.1f} GiB from {key}) cannot hold "
                          f"one sample of {prompt} + {r.max_new_tokens} tokens ({alone / GIB:.2f} GiB per GPU"
                          f"{with_state}): raise it, lower rollout.max_new_tokens / data.max_prompt_tokens, or split "
                          "the KV heads over more TP ranks / the layers over more PP stages")
    slots = max(1, min(samples, int(budget // (state + expected)))) if state else samples
    blocks = min(int((budget - slots * state) // block) - 1, math.ceil(samples * worst / block))
    capacity = int((budget - block) // (expected + state))
    concurrent = min(samples, slots, blocks * block // expected)
    tokens = max(16384, longest + concurrent)
    step = prefill_bytes(m, layout, Shape(tokens, 1, routed_load(cfg, layout)), fused_attention=True)
    if megatron_architecture(m).has_blocks(m, MAMBA):
        e = DTYPE_BYTES[m.precision]
        _, d_inner, _, width = mamba_sizes(m)
        step = max(step, e * tokens * (2 * m.hidden_size + (width + d_inner) / layout.tp))  # in_proj out, scan out
    step += (DTYPE_BYTES[m.precision] + 4) * concurrent * m.padded_vocab_size  # gathered logits, sampled in fp32
    return GenerationPlan(kv_cache=(blocks + 1) * block + slots * state, step=step, concurrent=int(concurrent),
                          samples=samples, gpus=layout.tp * layout.pp * layout.cp, expected_kv=expected,
                          worst_kv=worst, state=state, capacity=capacity, stages_in_series=layout.pp, group=group)
