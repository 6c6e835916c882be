"""Model weights as Megatron distributed checkpoints (``torch_dist``), loadable at any TP/PP/EP layout.

A weights directory holds the ``dist_checkpointing`` files plus ``model_config.json``: the
architecture it was made from. Loading into a model of another architecture fails before any tensor
is read, naming the fields that differ; a checkpoint missing tensors the model needs fails too (no
silent partial loads).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from dataclasses import asdict
from multiprocessing.managers import SyncManager
from typing import Any

import torch

from megatron_cascade.config.model import ModelConfig

MODEL_CONFIG_FILE = "model_config.json"

# Fields that change numerics or runtime, not the shape or meaning of the weights.
_NON_ARCHITECTURE_FIELDS = {
    "precision", "attention_dropout", "hidden_dropout", "init_method_std", "fp8",
    "max_position_embeddings",
}
_NON_ARCHITECTURE_MOE_FIELDS = {"token_dispatcher_type", "grouped_gemm", "aux_loss_coeff", "router_load_balancing_type"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded as asked; the message says why and what to do."""


def architecture_of(model: ModelConfig) -> dict[str, Any]:
    """The fields of ``model`` that a checkpoint's tensors depend on."""
    arch = {k: v for k, v in asdict(model).items() if k not in _NON_ARCHITECTURE_FIELDS}
    arch["moe"] = {k: v for k, v in arch["moe"].items() if k not in _NON_ARCHITECTURE_MOE_FIELDS}
    arch["padded_vocab_size"] = model.padded_vocab_size
    return arch


def read_model_config(ckpt_dir: str) -> dict[str, Any]:
    """The model config a weights directory was saved from (as a plain dict)."""
    path = os.path.join(ckpt_dir, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt_dir} is not a megatron-cascade weights directory: {MODEL_CONFIG_FILE} missing")
    with open(path) as f:
        return json.load(f)


def check_architecture(ckpt_dir: str, model: ModelConfig) -> None:
    """Raise ``CheckpointError`` if the checkpoint in ``ckpt_dir`` was made for another architecture."""
    saved = read_model_config(ckpt_dir)
    saved_arch = saved.get("architecture", saved)
    wanted = architecture_of(model)
    diffs = _diff(saved_arch, wanted)
    if diffs:
        lines = "\n".join(f"  {key}: checkpoint={a!r} model={b!r}" for key, a, b in diffs)
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was saved from another architecture than the configured model:\n{lines}\n"
            "Fix the model section of the config (or convert the checkpoint) so that they match."
        )


def _diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append((f"{prefix}{key}", va, vb))
    return out


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _signal_safe_writer_queue() -> None:
    """Start the checkpoint writer's result queue in a Manager that ignores stop signals.

    Megatron's torch_dist writer lazily starts a multiprocessing Manager; Slurm signals every
    process of a job step, and a Manager with default handlers dies on the preemption USR1/TERM
    in the middle of the very save that signal asked for. Ours ignores them (the trainer decides).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(_ignore_stop_signals)
        filesystem_async._results_queue = manager.Queue()
        _MANAGERS.append(manager)  # keep it alive as long as the queue is used


_MANAGERS: list = []


def save_model_weights(model: torch.nn.Module, ckpt_dir: str, model_config: ModelConfig) -> None:
    """Save ``model`` (this rank's shard) into ``ckpt_dir``; collective over all ranks."""
    from megatron.core import dist_checkpointing

    _signal_safe_writer_queue()
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    if _rank() == 0:
        with open(os.path.join(ckpt_dir, MODEL_CONFIG_FILE), "w") as f:
            json.dump({"architecture": architecture_of(model_config), "config": asdict(model_config)}, f, indent=2)
    _barrier()


def load_model_weights(model: torch.nn.Module, ckpt_dir: str, model_config: ModelConfig) -> None:
    """Load ``ckpt_dir`` into ``model`` at whatever layout the model has; collective over all ranks.

    Raises ``CheckpointError`` for another architecture, a missing directory or missing tensors.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    check_architecture(ckpt_dir, model_config)
    try:
        state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir, strict=StrictHandling.RAISE_ALL)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the directory named
        raise CheckpointError(f"could not load weights from {ckpt_dir}: {type(exc).__name__}: {exc}") from exc
    model.load_state_dict(state, strict=False)
    missing = _missing_after_load(model, state)
    if missing:
        raise CheckpointError(f"checkpoint {ckpt_dir} lacks tensors the model needs: {missing[:5]}")


def _missing_after_load(model: torch.nn.Module, state: dict) -> list[str]:
    wanted = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    return sorted(wanted - set(state))


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
