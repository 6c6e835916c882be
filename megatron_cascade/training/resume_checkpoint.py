"""Resumable training checkpoints, written atomically, loadable at another parallel layout.

A checkpoint is a folder ``step_00000N/`` holding
* ``weights/``: the model, a Megatron distributed checkpoint (any TP/PP/EP layout loads it);
* ``optim/`` (``optimizer_checkpoint.py``): the optimizer state (Adam moments, fp32 master weights with bf16/fp16, step, fp16 loss
  scale) as another distributed checkpoint, built from ``optimizer.sharded_state_dict`` and keyed by
  the model's tensors (the distributed optimizer in its ``fully_reshardable`` form), written and
  read fully in parallel over the data-parallel ranks: a run saved at DP=2/TP=2 resumes at DP=1/TP=1;
* ``rng/rank_XXXXX.pt``: each rank's RNG states (plain tensors, read back with ``weights_only``);
* ``state.json``: the step, the caller's state, the lr schedule and the layout it was written at.
It is written as ``step_00000N.partial/`` and renamed when every rank has finished and every file and
folder of it is fsynced; then the ``latest`` pointer is replaced atomically. A crash at any moment
leaves either the previous ``latest`` or the new one, never a half-written one. ``state.json`` records
every file's size and hash (each rank hashes the shards it wrote): a latest checkpoint damaged
afterwards (truncated, a file lost, a byte changed anywhere) is skipped with a warning for the previous
intact one (``checkpoint_safety.integrity``; a resume verifies every byte, each rank its share).
Nothing here unpickles code: ``.metadata`` files are read with an allow-list, objects, ``common.pt``
and the RNG files with ``weights_only=True`` (``checkpoint_safety``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from typing import Any, Optional

import torch

from megatron_cascade.checkpoint_safety.integrity import check_record, damage, fsync_path, fsync_tree
from megatron_cascade.model import CheckpointError, save_model_weights
from megatron_cascade.model.weights_checkpoint import _barrier, _rank, gathered_record, verify_files, write_file_record
from megatron_cascade.training.optimizer_checkpoint import load_optimizer_state, save_optimizer_state
from megatron_cascade.training.policy import Policy, finish_param_sync, load_policy_weights, unwrap

log = logging.getLogger(__name__)

LATEST = "latest"


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new content, never a mix."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))  # the rename itself, on stable storage


def _layout() -> dict[str, int]:
    """This run's parallel layout (what per-rank RNG states depend on)."""
    from megatron.core import parallel_state as ps

    return {"world_size": torch.distributed.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size()}


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_file(ckpt: str) -> str:
    return os.path.join(ckpt, "rng", f"rank_{_rank():05d}.pt")


def save_training_checkpoint(root: str, step: int, policy: Policy, state: dict[str, Any], keep_last: int) -> str:
    """Save policy + optimizer + schedule + RNG + ``state`` (JSON-able) as ``root/step_{step}``; collective."""
    name = f"step_{step:08d}"
    final, partial = os.path.join(root, name), os.path.join(root, f"{name}.partial")
    finish_param_sync(policy)  # the weights of this step, not the last all-gathered ones
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        for sub in ("rng", "optim"):
            os.makedirs(os.path.join(partial, sub), exist_ok=True)
    _barrier()
    save_model_weights(policy.module, os.path.join(partial, "weights"), policy.model_config, record=False)
    save_optimizer_state(policy, os.path.join(partial, "optim"))
    with open(_rng_file(partial), "wb") as f:
        torch.save(_rng_state(), f)
        f.flush()
        os.fsync(f.fileno())  # this rank's file, on its own node (rank 0 may sit on another)
    meta = {"step": step, **state, "scheduler": policy.scheduler.state_dict(), "layout": _layout(),
            "optimizer": {"distributed": policy.parallel.use_distributed_optimizer}}
    _barrier()
    meta["files"] = gathered_record(partial)  # each rank hashes the shards it wrote, still in its page cache
    if _rank() == 0:
        _seal(partial, meta)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        fsync_path(root)
        write_atomically(os.path.join(root, LATEST), name)  # only now: every file above is durable
        _prune(root, keep_last)
    _barrier()
    return final


def _seal(partial: str, meta: dict) -> None:
    """Write ``state.json`` (the completion marker, with the record of every other file's size and
    hash, so that a damaged checkpoint is recognised) and fsync the whole folder.

    Megatron fsyncs the tensor shards it writes, not ``common.pt`` / ``metadata.json``, nor does
    torch.save or json.dump; nothing fsyncs the folders' entries.
    """
    with open(os.path.join(partial, "state.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    fsync_tree(partial)


def _prune(root: str, keep_last: int) -> None:
    for stale in (d for d in os.listdir(root) if d.endswith(".partial")):
        shutil.rmtree(os.path.join(root, stale), ignore_errors=True)  # left by a crash mid-save
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".partial"))
    latest = read_latest(root)
    newest = os.path.basename(latest) if latest else None
    # Newer than the checkpoint just written: what a fallback abandoned (the damaged one, or
    # one whose ``latest`` never moved); left there, a later fallback could pick it up.
    abandoned = [d for d in steps if newest is not None and d > newest]
    kept = [d for d in steps if d not in abandoned]
    for old in abandoned + (kept[:-keep_last] if keep_last > 0 else []):
        if os.path.join(root, old) != latest:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json"))


def _file_record(path: str) -> dict | str | None:
    """The record in ``path/state.json`` (None: written before records existed), or why it is unreadable."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            record = json.load(f).get("files")
        return None if record is None else check_record(record)
    except (OSError, ValueError, AttributeError) as exc:
        return f"state.json unreadable ({exc})"


def _damage(path: str) -> Optional[str]:
    """Why the complete checkpoint ``path`` cannot be resumed from by a quick look (a file missing, of
    another size, or a small one rewritten; see ``_verified``), or None."""
    record = _file_record(path)
    return record if isinstance(record, str) else damage(path, record)


def read_latest(root: str, rejected: tuple[str, ...] = ()) -> Optional[str]:
    """The folder of the last complete, intact checkpoint under ``root``, or None.

    Follows the ``latest`` pointer; if what it names is gone or incomplete (a folder removed by
    hand, a file system that lost the rename), falls back to the newest complete ``step_*``. A
    complete checkpoint whose files differ from its record at a quick look (truncated, missing,
    small files rewritten) is skipped with a warning naming the file, for the newest intact one
    before it (``keep_last`` >= 2 keeps one); so are ``rejected`` ones (found damaged by a full
    verification, ``agreed_latest``). Every rank reaches the same answer: it depends only on the files.
    """
    pointer = os.path.join(root, LATEST)
    damaged: list[tuple[str, str]] = []
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if _complete(path) and path not in rejected:
            problem = _damage(path)
            if problem is None:
                return path
            damaged.append((path, problem))
    if not os.path.isdir(root):
        return None
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".partial"))
    found = None
    for path in reversed([os.path.join(root, d) for d in steps]):
        if not _complete(path) or path in rejected or any(path == bad for bad, _ in damaged):
            continue
        problem = _damage(path)
        if problem is None:
            found = path
            break
        damaged.append((path, problem))
    if damaged and _rank() == 0:
        for path, problem in damaged:
            log.warning("checkpoint %s is damaged (%s); %s", path, problem,
                        f"resuming from the previous intact checkpoint {found} instead" if found
                        else "no intact checkpoint is left before it: the stage starts over")
    return found


def agreed_latest(root: str) -> Optional[str]:
    """The checkpoint under ``root`` to resume from, the same on every rank, every byte verified
    (collective when distributed).

    Each rank reading the files itself can disagree on a cluster file system (a ``latest`` rename
    or a new folder not yet visible on every node): ranks would resume from different steps, or
    some start over. Rank 0 decides (``read_latest``) and broadcasts; a rank that cannot see that
    checkpoint raises ``CheckpointError`` on every rank (output_dir must be on a file system all
    nodes share). Then every rank hashes its share of the checkpoint's files against the record
    (``verify_files``); a checkpoint with a changed byte is skipped with a warning, as a truncated one is.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rejected: tuple[str, ...] = ()
    while True:
        choice = [read_latest(root, rejected) if _rank() == 0 else None]
        if distributed:
            dist.broadcast_object_list(choice, src=0)
            _everyone_sees(choice[0])
        latest = choice[0]
        if latest is None:
            return None
        record = _file_record(latest)
        problem = record if isinstance(record, str) else verify_files(latest, record)
        if problem is None:
            return latest
        if _rank() == 0:
            log.warning("checkpoint %s is damaged (%s); looking for the previous intact checkpoint", latest, problem)
        rejected += (latest,)


def _everyone_sees(latest: Optional[str]) -> None:
    import torch.distributed as dist

    sees = [None] * dist.get_world_size()
    dist.all_gather_object(sees, latest is None or _complete(latest))
    blind = [rank for rank, ok in enumerate(sees) if not ok]
    if blind:
        raise CheckpointError(f"rank 0 resumes from {latest}, which ranks {blind} cannot see: the run's output_dir "
                              "must be on a file system every node shares (and sees up to date)")


def load_training_checkpoint(path: str, policy: Policy) -> dict[str, Any]:
    """Restore policy, optimizer, schedule and RNG from ``path``; returns its ``state.json``; collective.

    Any parallel layout loads the weights and the optimizer. Per-rank RNG states are restored only
    at the layout they were saved at (elsewhere the stage's own seeding stands, and a line is logged).
    Raises ``CheckpointError`` when the checkpoint's optimizer kind differs from
    ``parallel.use_distributed_optimizer`` (their states are stored differently).
    """
    with open(os.path.join(path, "state.json")) as f:
        saved = json.load(f)
    _check_optimizer_kind(path, saved, policy)
    load_policy_weights(policy, os.path.join(path, "weights"))
    load_optimizer_state(policy, os.path.join(path, "optim"))  # fp32 masters from here, not the weights
    policy.scheduler.load_state_dict(saved["scheduler"])
    if saved.get("layout") == _layout() and os.path.isfile(_rng_file(path)):
        from megatron_cascade.checkpoint_safety import UnsafeCheckpointError
        from megatron_cascade.checkpoint_safety.restricted_pickle import weights_only_load

        try:
            states = weights_only_load(_rng_file(path), _rng_file(path))
        except UnsafeCheckpointError as exc:  # one line naming the file, not torch's traceback
            raise CheckpointError(str(exc)) from None
        _set_rng_state(states)
    elif _rank() == 0:
        log.info("%s was saved at layout %s, resuming at %s: RNG states not restored", path, saved.get("layout"),
                 _layout())
    return saved


def _check_optimizer_kind(path: str, saved: dict, policy: Policy) -> None:
    kind = saved.get("optimizer", {}).get("distributed")
    if kind is None:
        raise CheckpointError(f"{path} has no optimizer record in state.json: it was written by an older "
                              "version (per-rank optim/*.pt files); start the stage from its weights instead")
    if kind != policy.parallel.use_distributed_optimizer:
        raise CheckpointError(
            f"{path} holds {'distributed' if kind else 'plain'} optimizer state but "
            f"parallel.use_distributed_optimizer={policy.parallel.use_distributed_optimizer}: resume with "
            f"parallel.use_distributed_optimizer={str(kind).lower()} (the two store Adam state differently)")


def nonfinite_tensors(module: torch.nn.Module) -> list[str]:
    """Names of ``module``'s parameters holding a NaN or an infinity, over every rank (collective when
    distributed; each rank checks its shards)."""
    import torch.distributed as dist

    mine = [name for name, param in unwrap(module).named_parameters()
            if param.numel() and not bool(torch.isfinite(param.detach()).all())]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted({name for names in everyone for name in names})


def save_final_weights(path: str, policy: Policy, extra_files: dict[str, str]) -> None:
    """A stage's final weights (what later stages start from and MOPD teachers load), atomically.

    Raises ``CheckpointError`` naming the tensors (and seals nothing) when a weight is not finite: a
    stage that ended in NaN (a corrupted optimizer state, a diverged step) must not hand it on."""
    partial = f"{path}.partial"
    finish_param_sync(policy)
    bad = nonfinite_tensors(policy.module)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointError(f"refusing to seal {path}: non-finite values in {shown}; resume from an earlier "
                              "checkpoint of the stage (or lower the learning rate) instead")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    save_model_weights(policy.module, partial, policy.model_config, record=False)
    if _rank() == 0:
        for name, text in extra_files.items():
            with open(os.path.join(partial, name), "w") as f:
                f.write(text)
    _barrier()
    write_file_record(partial)  # what every later load (next stage, teachers, evaluation) verifies
    if _rank() == 0:
        fsync_tree(partial)  # durable before the manifest can call the stage complete
        shutil.rmtree(path, ignore_errors=True)
        os.rename(partial, path)
        fsync_path(os.path.dirname(os.path.abspath(path)))
    _barrier()
