"""Compare sharded models across parallel layouts by going through distributed checkpoints."""

from __future__ import annotations

import torch

from megatron_cascade.config.model import ModelConfig, ParallelConfig


def model_with_shared_weights(model_cfg: ModelConfig, parallel: ParallelConfig, weights_dir: str, init: bool,
                              seed: int) -> torch.nn.Module:
    """A ``GPTModel`` at ``parallel`` holding the same weights in every layout of a test: the
    reference run (``init``) saves its random init to ``weights_dir``, the others load it (resharded).
    Initialises Megatron's parallel state first."""
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights
    from megatron_cascade.model import save_model_weights

    initialize_model_parallel(parallel, seed=seed)
    model = build_gpt_model(model_cfg, parallel)
    if init:
        save_model_weights(model, weights_dir, model_cfg)
    else:
        load_model_weights(model, weights_dir, model_cfg)
    return model


def save_gradients_as_checkpoint(module: torch.nn.Module, ckpt_dir: str, model_cfg: ModelConfig) -> None:
    """Write this rank's gradients (``main_grad`` under DDP, else ``grad``) as a weights checkpoint.

    Overwrites the parameters with their gradients first: only for tests, at the end of a worker.
    """
    from megatron_cascade.model import save_model_weights

    with torch.no_grad():
        for param in module.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            param.copy_(torch.zeros_like(param) if grad is None else grad)
    save_model_weights(module, ckpt_dir, model_cfg)


def full_state_dict(model_cfg: ModelConfig, ckpt_dir: str) -> dict[str, torch.Tensor]:
    """A weights checkpoint re-assembled into a TP=PP=EP=1 model: {name: full tensor}.

    Re-initialises Megatron's parallel state (every rank holds the whole model afterwards).
    """
    from megatron.core import parallel_state

    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights

    parallel_state.destroy_model_parallel()
    initialize_model_parallel(ParallelConfig(), seed=0)
    model = build_gpt_model(model_cfg, ParallelConfig())
    load_model_weights(model, ckpt_dir, model_cfg)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
