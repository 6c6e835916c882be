"""The optimizer's state in a training checkpoint (``training/resume_checkpoint.py``'s ``optim/``): Adam
moments, fp32 master weights (bf16/fp16), step and loss scale as a Megatron distributed checkpoint
keyed by the model's spec-independent tensor names, in the distributed optimizer's
``fully_reshardable`` form, so that any layout reads it; written and read fully in parallel over the
data-parallel ranks."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_cascade.model.weights_checkpoint import CheckpointError, _signal_safe_writer_queue
from megatron_cascade.model.spec_layout import canonical_sharded_state_dict
from megatron_cascade.training.policy import Policy

# Megatron's layout-independent form of the distributed optimizer's state (model-space tensors).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _sub_optimizers(policy: Policy) -> list:
    return list(getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]))


def _model_sharded_state_dict(policy: Policy) -> dict:
    """The model's sharded tensors under the weights' spec-independent (TE) names: the optimizer
    state is keyed by them, so it resumes under another layer spec as the weights do."""
    return canonical_sharded_state_dict(policy.module.sharded_state_dict())


def _parallel_strategies(ckpt_dir: Optional[str] = None):
    """Fully parallel save (or load, with ``ckpt_dir``): data-parallel replicas split the work."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    from megatron_cascade.checkpoint_safety.megatron_load import SafeTorchDistLoadStrategy

    group = ps.get_data_parallel_group(with_context_parallel=True)
    if ckpt_dir is None:
        return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)
    # No file of the checkpoint may run code: allow-listed .metadata, weights_only objects.
    return FullyParallelLoadStrategyWrapper(SafeTorchDistLoadStrategy(), group)


def save_optimizer_state(policy: Policy, ckpt_dir: str) -> None:
    """Write the optimizer's state as a distributed checkpoint into ``ckpt_dir``; collective."""
    from megatron.core import dist_checkpointing

    _signal_safe_writer_queue()
    for opt in _sub_optimizers(policy):
        _allocate_state(opt)  # a checkpoint before the first step (e.g. all steps skipped so far)
    state = policy.optimizer.sharded_state_dict(_model_sharded_state_dict(policy), is_loading=False,
                                                metadata=_OPTIMIZER_METADATA)
    dist_checkpointing.save(state, ckpt_dir, sharded_strategy=_parallel_strategies())


def load_optimizer_state(policy: Policy, ckpt_dir: str) -> None:
    """Read ``save_optimizer_state``'s checkpoint into the policy's optimizer at this layout; collective.

    Its tensors are found by the model's sharded-tensor keys (spec-independent names, global shapes),
    so any layout reads them; with bf16/fp16 the fp32 master weights come from here (finer than the 16-bit weights).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_cascade.checkpoint_safety import UnsafeCheckpointError
    from megatron_cascade.checkpoint_safety.megatron_load import SafeCommonLoadStrategy

    subs = _sub_optimizers(policy)
    for opt in subs:
        _allocate_state(opt)  # the load fills the optimizer's tensors in place
    request = policy.optimizer.sharded_state_dict(_model_sharded_state_dict(policy), is_loading=True,
                                                  metadata=_OPTIMIZER_METADATA)
    try:
        loaded = dist_checkpointing.load(request, ckpt_dir, sharded_strategy=_parallel_strategies(ckpt_dir),
                                         common_strategy=SafeCommonLoadStrategy())  # common.pt: weights_only
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    states = [loaded] if len(subs) == 1 else [loaded[i] for i in range(len(subs))]
    for opt, state in zip(subs, states):
        if isinstance(opt, DistributedOptimizer):
            _load_distributed_optimizer(opt, state)
        else:
            _restore_zero_step(opt, state)
            opt.load_state_dict(state)


def _allocate_state(opt) -> None:
    """Give parameters without optimizer state (none before the first step) the state of a fresh Adam:
    zero moments and step 0, so that it can be saved and loaded like any other."""
    if getattr(opt, "init_state_fn", None) is not None:
        opt.init_state_fn(opt.optimizer, opt.config)  # Megatron's own: zero moments where missing
    _add_missing_steps(opt.optimizer)


def _restore_zero_step(opt, state: dict) -> None:
    """Megatron saves the plain optimizer's shared Adam ``step`` only when it is non-zero; torch's Adam
    refuses states without one: put the 0 back (as Megatron's ``common_step``) before loading."""
    if not isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    inner = state.get("optimizer", state)  # Float16Optimizer nests the torch state dict, FP32Optimizer not
    if "common_step" not in inner["state"]:
        inner["state"]["common_step"] = torch.tensor(0.0)


def _add_missing_steps(inner) -> None:
    """torch's Adam keeps a per-parameter ``step`` (fused Adams keep it in the param groups)."""
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for state in inner.state.values():
        if state and "step" not in state:
            state["step"] = torch.tensor(0.0)


def _load_distributed_optimizer(opt, state: dict) -> None:
    """``DistributedOptimizer.load_state_dict`` for a ``fully_reshardable`` state with torch's Adam.

    Megatron's version assumes a fused Adam without per-parameter ``step``: with torch's Adam it
    copies into a ``step`` the saved tensors lack (KeyError) and leaves every parameter sharing one
    ``step`` tensor, which Adam then increments once per parameter. Here the parameter state is
    loaded with ``step`` set aside, and each parameter gets its own copy of the loaded step.
    """
    param_state = state.pop("param_state")
    kind = state.pop("param_state_sharding_type")
    if kind != "fully_reshardable":
        raise CheckpointError(f"optimizer state of sharding type {kind!r}; this version reads 'fully_reshardable'")
    opt.load_state_dict(state)  # param groups, step, fp16 loss scale
    inner = opt.optimizer.state
    steps = {param: s.pop("step") for param, s in inner.items() if "step" in s}
    try:
        with torch.no_grad():  # fp32 main shards are views of parameters that require grad
            opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for param, step in steps.items():
            inner[param]["step"] = step.detach().clone()
