"""The trained policy: a GPTModel wrapped in Megatron's DDP, its optimizer and lr schedule.

Precision: with ``model.precision`` bf16/fp16 the model is wrapped in Megatron's ``Float16Module``
(as Megatron-LM does: every parameter, norms included, in the 16-bit dtype) and Megatron's
mixed-precision optimizer keeps fp32 master weights. Those masters are copied from the model when the
optimizer is built: weights loaded into the model later must be pushed into them
(``load_policy_weights``), or the first step writes the build-time init back over the loaded weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from megatron_cascade.config.model import FP8Config, ModelConfig, ParallelConfig
from megatron_cascade.config.training import OptimizerConfig, validate_optimizer_config
from megatron_cascade.model import build_gpt_model, load_model_weights
from megatron_cascade.model.builder import params_dtype


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
        """The unwrapped GPTModel (for checkpoints and generation).

        With the distributed optimizer and ``overlap_param_gather`` its parameters may lag one step
        behind the optimizer: call ``finish_param_sync`` before reading them outside a training step.
        """
        return unwrap(self.chunks[0])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (they all keep it in ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def in_model_precision(model: torch.nn.Module, model_cfg: ModelConfig) -> torch.nn.Module:
    """``model`` as Megatron-LM runs it at ``model.precision``: bf16/fp16 inside ``Float16Module``.

    The wrapper casts the parameters the layer specs leave in fp32 (the local spec's norms) to the
    16-bit dtype, so CPU and Transformer Engine models hold the same dtypes; fp32 models are returned
    as they are. Frozen models (teachers, KL reference) use it too, so that they compute exactly what
    the policy computes. Logits stay in the model dtype (see ``_float16_module_class``).
    """
    if params_dtype(model_cfg) is torch.float32:
        return model
    return _float16_module_class()(model.config, model)


def build_frozen_model(model_cfg: ModelConfig, parallel: ParallelConfig) -> torch.nn.Module:
    """A model for forward-only log-probs (teachers, the KL reference): at the policy's precision,
    in eval mode, no parameter requiring a gradient. Its weights are the caller's to load.

    FP8 policies get frozen models whose GEMMs run in bf16: delayed scaling derives each GEMM's scale
    from the amax history of earlier forwards, which a frozen model has not had (a checkpoint written
    from bf16 weights holds none; the teacher pool swaps weights, not scales, so every teacher would
    run with the first one's). bf16 gives the stored weights' own log-probs; the price is that a
    reference holding the policy's weights differs from the FP8 policy by FP8's rounding."""
    if model_cfg.fp8.format is not None:
        model_cfg = replace(model_cfg, fp8=FP8Config())
    model = in_model_precision(build_gpt_model(model_cfg, parallel), model_cfg).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


@functools.cache
def _float16_module_class() -> type:
    """Megatron's ``Float16Module`` returning outputs in the model dtype (built on first use, so that
    importing this module does not import Megatron).

    ``Float16Module`` upcasts the last stage's output (the [s, b, V/TP] logits) to a full fp32 copy.
    Our token log-probs (``ops/logprobs.py``) upcast the logits chunk by chunk and accumulate in fp32,
    which gives the same numbers as the upcast copy without holding it.
    """
    from megatron.core.transformer.module import Float16Module

    class Float16ModuleModelDtypeOutput(Float16Module):
        def forward(self, *inputs, fp32_output: bool = False, **kwargs):
            return super().forward(*inputs, fp32_output=fp32_output, **kwargs)

    return Float16ModuleModelDtypeOutput


def _finalize_grads_without_token_scaling(model, num_tokens=None, **kwargs):
    """Megatron's grad finalisation (DP all-reduce, tied-embedding sync) minus the 1/num_tokens scale:
    our losses are already divided by the global normaliser (see loss_plugin.py)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


def build_policy(model_cfg: ModelConfig, parallel: ParallelConfig, optim: OptimizerConfig, total_steps: int) -> Policy:
    """A fresh policy (random init; load weights with ``load_policy_weights``) with a new optimizer.

    Megatron's parallel state must be initialised. ``total_steps`` sets the lr decay horizon when
    ``optim.lr_decay_steps`` is null.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    validate_optimizer_config(optim, model_cfg)
    model = in_model_precision(build_gpt_model(model_cfg, parallel), model_cfg)
    config = model.config
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
    # The schedules multiply each micro-batch loss by this before backward (fp16 loss scaling; a
    # scale of 1 otherwise), as Megatron-LM sets it.
    config.grad_scale_func = optimizer.scale_loss
    scheduler = _build_scheduler(optimizer, optim, total_steps)
    return Policy([ddp], optimizer, scheduler, model_cfg, parallel)


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
        loss_scale=optim.loss_scale,
        initial_loss_scale=optim.initial_loss_scale,
        min_loss_scale=optim.min_loss_scale,
        loss_scale_window=optim.loss_scale_window,
        hysteresis=optim.hysteresis,
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



def load_policy_weights(policy: Policy, ckpt_dir: str) -> None:
    """Load a weights folder into the policy and make the optimizer's fp32 masters equal to it.

    The one way to put weights into a policy whose optimizer exists (stage warm start,
    init_checkpoint, resume): without the reload, bf16/fp16 masters keep the build-time init and
    the first step copies them back over the loaded weights. Collective over all ranks.
    """
    load_model_weights(policy.module, ckpt_dir, policy.model_config)
    policy.optimizer.reload_model_params()


def finish_param_sync(policy: Policy) -> None:
    """Make every rank's model parameters hold the optimizer's latest weights; collective.

    With the distributed optimizer and ``parallel.overlap_param_gather`` a step updates only this
    rank's shard and leaves the all-gather to the next training forward. Call this before anything
    else reads ``policy.module`` (saving, generation, evaluation). A no-op otherwise.
    """
    if not (policy.parallel.use_distributed_optimizer and policy.parallel.overlap_param_gather):
        return
    for chunk in policy.chunks:
        chunk.start_param_sync(force_sync=True)
