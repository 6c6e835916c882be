"""``run --dry-run``: the resolved parallel layout, per-GPU memory estimate and stage plan, no GPU touched."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_cascade.config import RunConfig, resolve_stage
from megatron_cascade.config.model import ModelConfig
from megatron_cascade.model import resolve_layout

GIB = 2**30


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model, split by how they are sharded."""

    embedding: int  # input embedding (+ output layer when untied)
    dense: int  # attention, norms, dense MLPs, routers, shared experts
    expert: int  # routed experts

    @property
    def total(self) -> int:
        return self.embedding + self.dense + self.expert


def count_parameters(m: ModelConfig) -> ParamCount:
    """Analytic parameter count of the GPTModel ``m`` describes."""
    h, heads = m.hidden_size, m.num_attention_heads
    hd = m.kv_channels or h // heads
    groups = m.num_query_groups or heads
    gate = 2 if m.activation == "swiglu" else 1
    attention = h * hd * (heads + 2 * groups) + heads * hd * h + 2 * h
    attention += (hd * (heads + 2 * groups) if m.add_qkv_bias else 0) + (2 * hd if m.qk_layernorm else 0)
    ffn = m.ffn_hidden_size or 4 * h
    dense_mlp = h * ffn * gate + ffn * h
    dense = expert = 0
    for layer in range(m.num_layers):
        dense += attention
        if m.moe.num_experts and layer % m.moe.layer_freq == 0:
            e_ffn = m.moe.ffn_hidden_size or ffn
            expert += m.moe.num_experts * (h * e_ffn * gate + e_ffn * h)
            dense += h * m.moe.num_experts
            shared = m.moe.shared_expert_intermediate_size or 0
            dense += h * shared * gate + shared * h
        else:
            dense += dense_mlp
    dense += h  # final norm
    embedding = m.padded_vocab_size * h * (1 if m.tie_embeddings else 2)
    return ParamCount(embedding, dense, expert)


def memory_per_gpu(cfg: RunConfig, world_size: int) -> dict[str, float]:
    """GiB per GPU of weights, gradients and optimizer state (the most loaded pipeline stage).

    bf16/fp16: 2-byte weights, fp32 grads and fp32 master + Adam moments (12 B/param); fp32: 4 + 4 + 8.
    The distributed optimizer shards the optimizer state over (expert-)data-parallel ranks.
    """
    layout = resolve_layout(cfg.model, cfg.parallel, world_size, check_this_machine=False)
    counts = count_parameters(cfg.model)
    # Embedding and output layer sit on the first and last pipeline stages: with PP > 1 the most
    # loaded stage holds one of them (untied) or the single shared one.
    embedding = counts.embedding if layout.pp == 1 else counts.embedding / (1 if cfg.model.tie_embeddings else 2)
    dense_per_gpu = counts.dense / (layout.tp * layout.pp) + embedding / layout.tp
    expert_per_gpu = counts.expert / (layout.ep * layout.etp * layout.pp)
    half = cfg.model.precision in ("bf16", "fp16")
    weight_b, grad_b, optim_b = (2, 4, 12) if half else (4, 4, 8)
    distributed = cfg.parallel.use_distributed_optimizer
    optim = optim_b * (dense_per_gpu / (layout.dp if distributed else 1)
                       + expert_per_gpu / (layout.expert_dp if distributed else 1))
    params = dense_per_gpu + expert_per_gpu
    return {"params_per_gpu_b": params / 1e9, "weights_gib": params * weight_b / GIB,
            "grads_gib": params * grad_b / GIB, "optimizer_gib": optim / GIB,
            "total_gib": (params * (weight_b + grad_b) + optim) / GIB}


def describe_plan(cfg: RunConfig) -> str:
    """The dry-run text: layout, parameters, memory per GPU, and one line per stage."""
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    layout = resolve_layout(cfg.model, cfg.parallel, world, check_this_machine=False)
    counts = count_parameters(cfg.model)
    mem = memory_per_gpu(cfg, world)
    lines = [
        f"cluster: {cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} GPU(s) = {world} ranks",
        f"layout: TP={layout.tp} PP={layout.pp} CP={layout.cp} EP={layout.ep} ETP={layout.etp} DP={layout.dp} "
        f"expert-DP={layout.expert_dp} sequence_parallel={cfg.parallel.sequence_parallel} "
        f"distributed_optimizer={cfg.parallel.use_distributed_optimizer}",
        f"model: {counts.total / 1e9:.2f}B parameters ({counts.expert / 1e9:.2f}B in routed experts), "
        f"precision={cfg.model.precision}, fp8={cfg.model.fp8.format or 'off'}",
        f"memory per GPU (weights + grads + optimizer, no activations): {mem['total_gib']:.1f} GiB "
        f"= {mem['weights_gib']:.1f} + {mem['grads_gib']:.1f} + {mem['optimizer_gib']:.1f} "
        f"of {cfg.cluster.gpu_memory_gib:.0f} GiB",
        "stages:",
    ]
    for stage_cfg in cfg.stages:
        s = resolve_stage(cfg, stage_cfg)
        teachers = f" teachers={s.teachers}" if s.teachers else ""
        lines.append(
            f"  {s.name:<14} {s.type:<5} steps={s.steps:<4} batch={s.prompts_per_step}x{s.samples_per_prompt} "
            f"max_new_tokens={s.rollout.max_new_tokens} lr={s.optimizer.lr:g} kl={s.loss.kl_coef:g} "
            f"domains={s.domains}{teachers}")
    if mem["total_gib"] > cfg.cluster.gpu_memory_gib:
        lines.append(f"WARNING: {mem['total_gib']:.1f} GiB per GPU exceeds cluster.gpu_memory_gib")
    return "\n".join(lines)
