"""Model weights as Megatron distributed checkpoints (``torch_dist``), loadable at any TP/PP/EP layout.

A weights directory holds the ``dist_checkpointing`` files plus ``model_config.json``: the
architecture it was made from, and ``files.json``: every other file's size and hash (XXH3-128), verified
(each rank its share) before anything is read, so a flipped byte in any shard is refused by name. Tensors are stored under the canonical (Transformer Engine spec) keys
of ``spec_layout``, so weights saved from the local spec on CPU load into the TE spec on GPU and back.
Loading into a model of another architecture fails before any tensor is read, naming the fields that
differ; a checkpoint that lacks a tensor the model needs, holds one at another shape, or holds one the
model does not have fails too, naming the tensors (no silent partial loads). Only ``_extra_state``
objects (TE FP8 metadata, no weights) may be absent or unknown. No file of the checkpoint can run
code: ``.metadata`` is read with an allow-list, objects and ``common.pt`` with ``weights_only``
(``checkpoint_safety``); a file that would is refused with ``CheckpointError`` naming it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from dataclasses import asdict
from multiprocessing import resource_tracker
from multiprocessing.managers import SyncManager
from typing import Any

import torch

from megatron_cascade.checkpoint_safety import UnsafeCheckpointError
from megatron_cascade.checkpoint_safety.extra_state import check_extra_states
from megatron_cascade.checkpoint_safety.integrity import check_record, damage, merge_shares, owner_rank, record_share
from megatron_cascade.config.model import ModelConfig
from megatron_cascade.model.spec_layout import canonical_sharded_state_dict, is_extra_state, resolve_legacy_keys

MODEL_CONFIG_FILE = "model_config.json"
FILE_RECORD = "files.json"  # every other file's size and hash (``checkpoint_safety.integrity``)

# Fields that change numerics or runtime, not the shape or meaning of the weights.
_NON_ARCHITECTURE_FIELDS = {
    "precision", "attention_dropout", "hidden_dropout", "init_method_std", "fp8",
    "max_position_embeddings", "recompute", "recompute_num_layers",
}
_NON_ARCHITECTURE_MOE_FIELDS = {
    "token_dispatcher_type", "grouped_gemm", "aux_loss_coeff", "router_load_balancing_type", "router_bias_update_rate",
}
# The scan's chunk size changes float rounding only (hybrid models).
_NON_ARCHITECTURE_HYBRID_FIELDS = {"mamba_chunk_size"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded as asked; the message says why and what to do."""


def architecture_of(model: ModelConfig) -> dict[str, Any]:
    """The fields of ``model`` that a checkpoint's tensors depend on."""
    arch = {k: v for k, v in asdict(model).items() if k not in _NON_ARCHITECTURE_FIELDS}
    arch["moe"] = {k: v for k, v in arch["moe"].items() if k not in _NON_ARCHITECTURE_MOE_FIELDS}
    arch["hybrid"] = {k: v for k, v in arch["hybrid"].items() if k not in _NON_ARCHITECTURE_HYBRID_FIELDS}
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
    # A field missing from the file was added to the config after the checkpoint was written: the
    # checkpoint was trained with that field's default.
    saved_arch = _with_defaults(saved.get("architecture", saved), architecture_of(ModelConfig()))
    wanted = architecture_of(model)
    diffs = _diff(saved_arch, wanted)
    if diffs:
        lines = "\n".join(f"  {key}: checkpoint={a!r} model={b!r}" for key, a, b in diffs)
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was saved from another architecture than the configured model:\n{lines}\n"
            "Fix the model section of the config (or convert the checkpoint) so that they match."
        )


def _with_defaults(saved: dict, defaults: dict) -> dict:
    out = dict(saved)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _with_defaults(out[key], value)
    return out


def _diff(a: dict, b: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append((f"{prefix}{key}", va, vb))
    return out


_STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


_PR_SET_PDEATHSIG = 1


def _ignore_stop_signals(trainer_pid: int) -> None:
    """The manager's initializer: ignore stop signals, then take delivery again (it was born with
    them blocked, see ``_signal_safe_writer_queue``; one that arrived meanwhile is now discarded);
    and die with the trainer (a SIGKILLed trainer left its manager, ~270 MiB, running forever)."""
    import ctypes

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != trainer_pid:  # the trainer died before the death signal was armed
        os._exit(1)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def _signal_safe_writer_queue() -> None:
    """Start the checkpoint writer's result queue in a Manager that ignores stop signals.

    Megatron's torch_dist writer lazily starts a multiprocessing Manager; Slurm signals every
    process of a job step, and a Manager with default handlers dies on the preemption USR1/TERM
    in the middle of the very save that signal asked for. Ours ignores them (the trainer decides),
    and is started with them blocked: between its birth and its initializer a signal to the process
    group killed it (EOFError here, exit 1 instead of the requeue's 75). A signal the trainer gets
    meanwhile waits until the manager is up, then reaches the trainer's own handler.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        # multiprocessing's resource tracker, started with the first spawned process, unblocks SIGINT
        # and SIGTERM on its way out: have it running before the mask is set.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # inherited by the child
        try:
            manager.start(_ignore_stop_signals, (os.getpid(),))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        filesystem_async._results_queue = manager.Queue()
        _MANAGERS.append(manager)  # keep it alive as long as the queue is used


_MANAGERS: list = []


def save_model_weights(model: torch.nn.Module, ckpt_dir: str, model_config: ModelConfig, record: bool = True) -> None:
    """Save ``model`` (this rank's shard) into ``ckpt_dir``; collective over all ranks.

    ``record``: write ``files.json`` (``write_file_record``), which every load verifies; False when the
    caller records a larger folder itself (a training checkpoint) or adds files first.
    """
    from megatron.core import dist_checkpointing

    _signal_safe_writer_queue()
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(canonical_sharded_state_dict(model.sharded_state_dict()), ckpt_dir)
    if _rank() == 0:
        with open(os.path.join(ckpt_dir, MODEL_CONFIG_FILE), "w") as f:
            json.dump({"architecture": architecture_of(model_config), "config": asdict(model_config)}, f, indent=2)
    _barrier()
    if record:
        write_file_record(ckpt_dir)


def gathered_record(folder: str) -> dict[str, dict] | None:
    """The size and hash of every file under ``folder``, each rank hashing the shards it wrote; the
    whole record on rank 0, None elsewhere. Collective over all ranks."""
    shares = _gather(record_share(folder, _rank(), _world_size()))
    return merge_shares(folder, shares) if _rank() == 0 else None


def write_file_record(folder: str) -> None:
    """Write ``folder/files.json``: the record ``load_model_weights`` verifies. Collective."""
    record = gathered_record(folder)
    if _rank() == 0:
        with open(os.path.join(folder, FILE_RECORD), "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
    _barrier()


def verify_files(folder: str, record: dict[str, dict] | None) -> str | None:
    """The first problem any rank finds in ``folder`` against ``record`` (same answer on every rank),
    or None: sizes everywhere, and every file's hash, each rank hashing its share. Collective."""
    rank, world = _rank(), _world_size()
    problems = _gather(damage(folder, record, verify=lambda rel: owner_rank(rel, world) == rank))
    return next((problem for problem in problems if problem), None)


def load_model_weights(model: torch.nn.Module, ckpt_dir: str, model_config: ModelConfig) -> None:
    """Load ``ckpt_dir`` into ``model`` at whatever layout the model has; collective over all ranks.

    Reads canonical (TE) or legacy local-spec keys, whichever the checkpoint holds. Raises
    ``CheckpointError`` (on every rank) for another architecture, a missing directory, or tensors
    missing, of another shape or unknown to the model.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_cascade.checkpoint_safety.megatron_load import safe_load_strategies

    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    check_file_record(ckpt_dir)
    check_architecture(ckpt_dir, model_config)
    stored = _stored_metadata(ckpt_dir)
    tensors = {v.key: tuple(v.global_shape) for v in stored.values() if not _is_object(v)}
    request = resolve_legacy_keys(canonical_sharded_state_dict(model.sharded_state_dict()), set(tensors))
    # _extra_state the checkpoint lacks (local-spec or converted checkpoints into TE): keep the module's own.
    request = {k: v for k, v in request.items() if not (_is_object(v) and is_extra_state(v.key)
                                                         and v.unique_key not in stored)}
    _check_tensors(request, tensors, ckpt_dir)
    sharded_strategy, common_strategy = safe_load_strategies()  # no file of the checkpoint may run code
    try:
        # Mismatches were checked above; unread checkpoint _extra_state (TE norms into the local spec) is fine.
        state = dist_checkpointing.load(request, ckpt_dir, sharded_strategy=sharded_strategy,
                                        common_strategy=common_strategy, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    except CheckpointError:
        raise
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - re-raised with the directory named
        raise CheckpointError(f"could not load weights from {ckpt_dir}: {type(exc).__name__}: {exc}") from exc
    try:
        check_extra_states(state, ckpt_dir)  # TE's set_extra_state pickle.loads them
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    model.load_state_dict(state, strict=False)
    missing = _missing_after_load(model, state)
    if missing:
        raise CheckpointError(f"checkpoint {ckpt_dir} lacks tensors the model needs: {missing[:5]}")


def check_file_record(ckpt_dir: str) -> None:
    """Raise ``CheckpointError`` (on every rank) if a file of ``ckpt_dir`` differs from its ``files.json``.
    A folder without one (converted or written before records existed) is not checked."""
    path = os.path.join(ckpt_dir, FILE_RECORD)
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            record = check_record(json.load(f))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); re-copy the checkpoint") from None
    problem = verify_files(ckpt_dir, record)
    if problem:
        raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: {problem}; re-copy it (or re-create it)")


def _stored_metadata(ckpt_dir: str) -> dict[str, Any]:
    """{tensor key or object unique key: metadata entry} of a distributed checkpoint (no data is read)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from megatron_cascade.checkpoint_safety.megatron_load import safe_load_strategies

    try:
        return load_sharded_metadata(ckpt_dir, *safe_load_strategies())
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any failure here means an unreadable checkpoint
        raise CheckpointError(f"{ckpt_dir} is not a readable distributed checkpoint: "
                              f"{type(exc).__name__}: {exc}") from exc


def _is_object(entry: Any) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return isinstance(entry, ShardedObject)


def _requested_shapes(request: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """{checkpoint key: global shape} of the tensors in a sharded state dict (factories built)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    shapes = {}
    for entry in request.values():
        if _is_object(entry):
            continue
        parts = [entry]
        if isinstance(entry, ShardedTensorFactory):
            built = entry.build()
            parts = list(built.values()) if isinstance(built, dict) else list(built)
        for part in parts:
            shapes[part.key] = tuple(part.global_shape)
    return shapes


def _check_tensors(request: dict[str, Any], stored: dict[str, tuple[int, ...]], ckpt_dir: str) -> None:
    """Raise ``CheckpointError`` on every rank if any rank's tensors and the checkpoint's differ.

    ``stored``: {key: global shape} of the checkpoint's tensors. A key the checkpoint holds that no
    rank asks for is "unknown to the model" (pipeline stages each ask for their own layers).
    """
    wanted = _requested_shapes(request)
    missing = sorted(k for k in wanted if k not in stored)
    reshaped = sorted(f"{k} (checkpoint {list(stored[k])}, model {list(s)})"
                      for k, s in wanted.items() if k in stored and stored[k] != s)
    ranks = _gather((missing, reshaped, sorted(wanted)))
    missing = sorted({k for r in ranks for k in r[0]})
    reshaped = sorted({k for r in ranks for k in r[1]})
    unknown = sorted(set(stored) - {k for r in ranks for k in r[2]})
    problems = [f"{what} ({len(keys)}): {keys[:6]}{' ...' if len(keys) > 6 else ''}"
                for what, keys in (("tensors the model needs that the checkpoint lacks", missing),
                                   ("tensors of another shape", reshaped),
                                   ("tensors the model does not have", unknown)) if keys]
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not match the model: " + "; ".join(problems)
                              + ". It was saved from another model (or is incomplete): convert it or fix the "
                              "model section of the config.")


def _gather(obj: Any) -> list[Any]:
    """``obj`` from every rank (just ``[obj]`` without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _missing_after_load(model: torch.nn.Module, state: dict) -> list[str]:
    wanted = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    return sorted(wanted - set(state))


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
