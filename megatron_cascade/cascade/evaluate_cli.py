"""``megatron-cascade eval``: score a weights folder on every domain's held-out set."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_cascade.cascade.evaluation import evaluate
from megatron_cascade.cascade.runner import build_context
from megatron_cascade.cascade.runtime import init_distributed, is_main_rank, shutdown_distributed
from megatron_cascade.config import ConfigError, RunConfig
from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights, resolve_layout
from megatron_cascade.training.policy import in_model_precision, unwrap


def eval_model(cfg: RunConfig, weights: str) -> torch.nn.Module:
    """The frozen model ``weights`` load into, at the precision training ran it in (bf16 / fp16 inside
    ``Float16Module``, norms included), so that scores equal the in-training evaluation's."""
    model = in_model_precision(build_gpt_model(cfg.model, cfg.parallel), cfg.model).eval()
    load_model_weights(unwrap(model), weights, cfg.model)
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def evaluate_weights(cfg: RunConfig, weights: Optional[str]) -> Optional[dict[str, float]]:
    """Scores per domain (on rank 0; None elsewhere). ``weights`` None = the last complete stage."""
    init_distributed(cfg.distributed.timeout_minutes)
    try:
        resolve_layout(cfg.model, cfg.parallel, dist.get_world_size())
        initialize_model_parallel(cfg.parallel, cfg.seed, timeout_minutes=cfg.distributed.timeout_minutes)
        ctx = build_context(cfg)
        if weights is None:
            done = [s.name for s in cfg.stages if ctx.manifest.is_complete(s.name)]
            if not done:
                raise ConfigError(f"no complete stage in {cfg.output_dir}; pass --weights DIR")
            weights = ctx.manifest.final_weights(done[-1])
        model = eval_model(cfg, weights)
        scores = evaluate(model, ctx.eval_sets, ctx.eval_rewards, cfg.domains, ctx.tokenizer, cfg.eval, cfg.rollout,
                          seed=cfg.seed, generation_wait_minutes=cfg.distributed.generation_wait_minutes)
        return scores if is_main_rank() else None
    finally:
        shutdown_distributed()
