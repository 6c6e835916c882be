"""One stage's memory plan per GPU: static state, frozen models, the larger of generation and training."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_cascade.cascade.plan.activations import (Shape, fused_head_bytes, logits_bytes, routed_load, samples_truncated,
                                                      training_activation_bytes)
from megatron_cascade.cascade.plan.checks import check_decode_layout, decode_copy_bytes
from megatron_cascade.cascade.plan.generation import GenerationPlan, generation_plan
from megatron_cascade.cascade.plan.params import DTYPE_BYTES, GIB, memory_per_gpu, params_per_gpu
from megatron_cascade.config import RunConfig
from megatron_cascade.config.schema import ResolvedStage
from megatron_cascade.config.stage_types import stage_type
from megatron_cascade.model import Layout


# -- one stage's plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageMemory:
    """GiB per GPU (host: per node) for one stage."""

    static: float  # weights + grads + optimizer
    frozen: float  # KL reference or resident MOPD teacher
    kv_cache: float
    generation: float  # KV cache + one generation step (layer intermediates, sampled rows' logits)
    activations: float
    logits: float  # the output head: truncated sampling's logits and their gradient, else the fused head
    host_teachers: float  # offloaded MOPD teachers, per node
    overhead: float  # cluster.runtime_overhead_gib: CUDA context, NCCL, workspaces
    generation_plan: Optional[GenerationPlan] = None  # generating stages
    decode_copy: float = 0.0  # the decode copy's weights (rollout.parallel), resident; refit per step
    decode_layout: Optional[Layout] = None
    parked: float = 0.0  # of static, on the host while generating: grads, optimizer (+ weights beside a copy)
    host_training_state: float = 0.0  # the parked state, per node (``rollout.offload_training_state``)

    @property
    def training(self) -> float:
        return self.activations + self.logits

    @property
    def peak(self) -> float:
        # The decode copy holds its weights while generating only (released for training, refit after);
        # the parked training state is back for training only.
        generating = self.decode_copy + self.generation - self.parked
        return self.static + self.frozen + max(generating, self.training) + self.overhead


def stage_memory(cfg: RunConfig, layout: Layout, stage: ResolvedStage) -> StageMemory:
    """The memory plan of ``stage`` on one GPU (see the module docstring)."""
    m = cfg.model
    e = DTYPE_BYTES[m.precision]
    dense, expert = params_per_gpu(cfg, layout)
    kind = stage_type(stage.type)
    samples = stage.prompts_per_step * (stage.samples_per_prompt if kind.generates else 1) // layout.dp
    prompt = min(cfg.data.max_prompt_tokens, m.max_position_embeddings)
    seq = min(m.max_position_embeddings, prompt + (stage.rollout.max_new_tokens if kind.generates else 0))
    micro = stage.training.micro_batch_size
    in_flight = min(layout.pp, max(1, math.ceil(samples / micro)))
    train_shape = Shape(seq, micro, routed_load(cfg, layout))
    activations = training_activation_bytes(cfg, layout, train_shape, in_flight)
    head = logits_bytes if samples_truncated(stage) else fused_head_bytes
    logits = head(m, layout, seq / layout.cp * micro)
    frozen_weights = e * (dense + expert)
    with_reference = kind.kl_reference and stage.loss.kl_coef > 0
    frozen = frozen_weights if (with_reference or kind.teachers) else 0.0
    state = memory_per_gpu(cfg, layout.world_size)
    static = state["total_gib"] * GIB
    kv = generation = copy = parked = 0.0
    gen = decode = None
    if kind.generates:
        # A decode layout generates on its own copy of the weights (no optimizer state); the training
        # state stays beside it unless parked on the host (the weights too, once the copy is refit).
        decode = check_decode_layout(cfg, stage, layout.world_size)
        if decode is not None:
            copy = decode_copy_bytes(cfg, decode)
        if stage.rollout.offload_training_state:  # the policy's weights too when the copy generates
            parked = (state["grads_gib"] + state["optimizer_gib"] + (state["weights_gib"] if copy else 0)) * GIB
        free = (cfg.cluster.gpu_memory_gib * GIB - static + parked - copy - frozen
                - cfg.cluster.runtime_overhead_gib * GIB)
        gen = generation_plan(cfg, decode or layout, stage, free)
        kv, generation = gen.kv_cache, gen.kv_cache + gen.step
    distinct_teachers = len(set(stage.teachers.values())) if kind.teachers else 0
    host = distinct_teachers * frozen_weights * cfg.cluster.gpus_per_node
    return StageMemory(static / GIB, frozen / GIB, kv / GIB, generation / GIB, activations / GIB, logits / GIB,
                       host / GIB, cfg.cluster.runtime_overhead_gib, gen, copy / GIB, decode, parked / GIB,
                       parked * cfg.cluster.gpus_per_node / GIB)
