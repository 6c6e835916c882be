"""``run --dry-run``'s text: layout, parameters, memory per GPU, one line per stage."""

from __future__ import annotations

from megatron_cascade.cascade.plan.activations import routed_load, samples_truncated
from megatron_cascade.cascade.plan.checks import check_decode_layout, check_runnable, decode_copy_bytes
from megatron_cascade.cascade.plan.generation import GenerationPlan
from megatron_cascade.cascade.plan.params import GIB, count_parameters, memory_per_gpu
from megatron_cascade.cascade.plan.stage_memory import StageMemory, stage_memory
from megatron_cascade.config import RunConfig, resolve_stage
from megatron_cascade.config.schema import ResolvedStage
from megatron_cascade.config.stage_types import stage_type
from megatron_cascade.model import resolve_layout


def _concurrency(mem: StageMemory) -> str:
    gen = mem.generation_plan
    if gen is None:
        return ""
    mib = 2**20
    state = f" + state {gen.state / mib:.0f}" if gen.state else ""
    return (f"; per sample {gen.expected_kv / mib:.0f} MiB expected / {gen.worst_kv / mib:.0f} worst"
            f"{gen.prompt_sharing}{state}; "
            f"{gen.concurrent} of {gen.samples} samples at once = {gen.concurrent_per_gpu:.1f}/GPU, "
            f"room for {gen.capacity_per_gpu:.0f}/GPU{_in_series(gen)}")


def _in_series(gen: GenerationPlan) -> str:
    if gen.stages_in_series == 1:
        return ""
    return (f"; {gen.stages_in_series} pipeline stages decode in series: "
            f"{gen.concurrent_per_gpu / gen.stages_in_series:.1f}/GPU at work")


def _memory_line(name: str, mem: StageMemory, stage: ResolvedStage, cfg: RunConfig) -> str:
    frozen = ""
    if mem.frozen:
        frozen = f" + {'teacher' if stage_type(stage.type).teachers else 'kl-reference'} {mem.frozen:.1f}"
    on_host = [f"{gib:.1f} GiB/node of {what}" for gib, what in
               ((mem.host_teachers, "offloaded teachers"), (mem.host_training_state, "parked training state"))
               if gib]
    host = f"; host: {', '.join(on_host)}" if on_host else ""
    copy = f"decode copy {mem.decode_copy:.1f} + " if mem.decode_layout is not None else ""
    parked = ""
    if mem.parked:
        what = "weights, grads and optimizer" if mem.decode_layout is not None else "grads and optimizer"
        parked = f" - {what} on host {mem.parked:.1f}"
    return (f"  {name:<16} peak {mem.peak:6.1f} GiB = static {mem.static:.1f}{frozen} + max({copy}generation "
            f"{mem.generation:.1f} [KV cache {mem.kv_cache:.1f}{_concurrency(mem)}]{parked}, training {mem.training:.1f} [activations "
            f"{mem.activations:.1f} recompute={cfg.model.recompute}, {_head_name(stage)} {mem.logits:.1f}]) + runtime "
            f"{mem.overhead:.1f}{host}")


def _head_name(stage: ResolvedStage) -> str:
    return "logits (top-k/top-p)" if samples_truncated(stage) else "fused head"


def describe_plan(cfg: RunConfig) -> str:
    """The dry-run text: layout, parameters, memory per GPU, one line per stage; ``ConfigError`` for
    a layout or option the code cannot run."""
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    layout = resolve_layout(cfg.model, cfg.parallel, world, check_this_machine=False)
    check_runnable(cfg, layout)
    counts = count_parameters(cfg.model)
    mem = memory_per_gpu(cfg, world)
    lines = [
        f"cluster: {cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} GPU(s) = {world} ranks, "
        f"{cfg.cluster.gpu_memory_gib:g} GiB each, transformer_engine={cfg.cluster.transformer_engine}",
        f"layout: TP={layout.tp} PP={layout.pp} CP={layout.cp} EP={layout.ep} ETP={layout.etp} DP={layout.dp} "
        f"expert-DP={layout.expert_dp} sequence_parallel={cfg.parallel.sequence_parallel} "
        f"distributed_optimizer={cfg.parallel.use_distributed_optimizer}",
        f"model: {counts.total / 1e9:.2f}B parameters ({counts.expert / 1e9:.2f}B in routed experts), "
        f"precision={cfg.model.precision}, fp8={cfg.model.fp8.format or 'off'}, recompute={cfg.model.recompute}",
        f"memory per GPU (weights + grads + optimizer): {mem['total_gib']:.1f} GiB "
        f"= {mem['weights_gib']:.1f} + {mem['grads_gib']:.1f} + {mem['optimizer_gib']:.1f} "
        f"of {cfg.cluster.gpu_memory_gib:.0f} GiB",
        "stages:",
    ]
    stages = [resolve_stage(cfg, stage_cfg) for stage_cfg in cfg.stages]
    for s in stages:
        teachers = f" teachers={s.teachers}" if s.teachers else ""
        lines.append(
            f"  {s.name:<14} {s.type:<5} steps={s.steps:<4} batch={s.prompts_per_step}x{s.samples_per_prompt} "
            f"max_new_tokens={s.rollout.max_new_tokens} lr={s.optimizer.lr:g} kl={s.loss.kl_coef:g} "
            f"domains={s.domains}{teachers}")
        decode = check_decode_layout(cfg, s, world) if stage_type(s.type).generates else None
        if decode is not None:
            copy = decode_copy_bytes(cfg, decode)
            graphs = (f"; decode steps on {s.rollout.cuda_graphs} CUDA graph sizes, captured per generate call"
                      if s.rollout.cuda_graphs else "")
            pipeline = f" PP={decode.pp}" if decode.pp > 1 else ""
            lines.append(f"    decode layout: TP={decode.tp}{pipeline} EP={decode.ep} ETP={decode.etp} DP={decode.dp} "
                         f"(rollout.parallel; refit {copy / GIB:.2f} GiB per GPU per step, in memory{graphs})")
    load = routed_load(cfg, layout)
    lines.append("memory plan per GPU (GiB; peak = static + frozen models + max([decode copy +] generation [- parked "
                 "training state], training) + runtime overhead" + (f"; routed experts at {load:g}x the mean load" if load > 1 else "") + "):")
    warnings = []
    for s in stages:
        plan = stage_memory(cfg, layout, s)
        lines.append(_memory_line(s.name, plan, s, cfg))
        if plan.peak > cfg.cluster.gpu_memory_gib:
            warnings.append(f"WARNING: stage {s.name}: {plan.peak:.1f} GiB per GPU exceeds cluster.gpu_memory_gib="
                            f"{cfg.cluster.gpu_memory_gib:g}")
    return "\n".join(lines + warnings)
