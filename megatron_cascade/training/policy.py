"""The trained policy: a GPTModel wrapped in Megatron's DDP, its optimizer and lr schedule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_cascade.config.model import ConfigError, ModelConfig, ParallelConfig
from megatron_cascade.config.training import OptimizerConfig
from megatron_cascade.model import build_gpt_model
from megatron_cascade.model.builder import params_dtype

_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class Policy:
    """Everything one optimizer step touches. ``chunks`` is the list Megatron's schedules take."""

    chunks: list  # [DistributedDataParallel]
    optimizer: object  # megatron.core.optimizer.MegatronOptimizer
    scheduler: object  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    model_config: ModelConfig
    parallel: ParallelConfig

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped GPTModel (for checkpoints and generation)."""
        return self.chunks[0].module


def _finalize_grads_without_token_scaling(model, num_tokens=None, **kwargs):
    """Megatron's grad finalisation (DP all-reduce, tied-embedding sync) minus the 1/num_tokens scale:
    our losses are already divided by the global normaliser (see loss_plugin.py)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


def build_policy(model_cfg: ModelConfig, parallel: ParallelConfig, optim: OptimizerConfig, total_steps: int) -> Policy:
    """A fresh policy (random init; load weights into ``policy.module`` afterwards) with a new optimizer.

    Megatron's parallel state must be initialised. ``total_steps`` sets the lr decay horizon when
    ``optim.lr_decay_steps`` is null.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    validate_optimizer_config(optim)
    model = build_gpt_model(model_cfg, parallel)
    config = model.config
    config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=parallel.use_distributed_optimizer,
            overlap_grad_reduce=parallel.overlap_grad_reduce,
            overlap_param_gather=parallel.overlap_param_gather,
        ),
        model,
    )
    config.finalize_model_grads_func = _finalize_grads_without_token_scaling
    config.no_sync_func = ddp.no_sync
    optimizer = _build_optimizer(ddp, model_cfg, parallel, optim)
    scheduler = _build_scheduler(optimizer, optim, total_steps)
    return Policy([ddp], optimizer, scheduler, model_cfg, parallel)


def validate_optimizer_config(optim: OptimizerConfig) -> None:
    """Raise ``ConfigError`` naming the key for impossible optimizer settings."""
    if optim.lr_decay_style not in _DECAY_STYLES:
        raise ConfigError(f"optimizer.lr_decay_style={optim.lr_decay_style!r} is not one of {list(_DECAY_STYLES)}")
    if not 0 <= optim.min_lr <= optim.lr:
        raise ConfigError(f"optimizer.min_lr={optim.min_lr} must be in [0, optimizer.lr={optim.lr}]")
    if not 0 <= optim.lr_warmup_init <= optim.lr:
        raise ConfigError(f"optimizer.lr_warmup_init={optim.lr_warmup_init} must be in [0, optimizer.lr={optim.lr}]")
    if optim.lr_warmup_steps < 0 or optim.clip_grad < 0 or optim.weight_decay < 0:
        raise ConfigError("optimizer.lr_warmup_steps, optimizer.clip_grad and optimizer.weight_decay must be >= 0")


def _build_optimizer(ddp, model_cfg: ModelConfig, parallel: ParallelConfig, optim: OptimizerConfig):
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    dtype = params_dtype(model_cfg)
    config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, [ddp])


def _build_scheduler(optimizer, optim: OptimizerConfig, total_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = optim.lr_decay_steps or total_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=optim.lr_warmup_init,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        # Megatron requires decay steps > warmup steps; "constant" ignores them anyway.
        lr_decay_steps=max(decay_steps, optim.lr_warmup_steps + 1),
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(1, total_steps),
        wd_incr_style="constant",
    )

