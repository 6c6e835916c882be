"""Resumable training checkpoints, written atomically.

A checkpoint is a folder ``step_00000N/`` holding ``weights/`` (a Megatron distributed checkpoint,
any layout can load it), ``optim/rank_XXXXX.pt`` (this rank's optimizer, lr schedule and RNG states:
resume needs the same parallel layout) and ``state.json``. It is written as ``step_00000N.partial/``
and renamed when every rank has finished; then the ``latest`` pointer is replaced atomically. A crash
at any moment leaves either the previous ``latest`` or the new one, never a half-written one.
With the distributed optimizer (GPU), its sharded parameter state (Adam moments, fp32 master
weights) goes to ``optim/distributed_optimizer.pt`` through Megatron's ``save_parameter_state``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any, Optional

import torch

from megatron_cascade.model import load_model_weights, save_model_weights
from megatron_cascade.model.checkpoint import _barrier, _rank
from megatron_cascade.training.policy import Policy

LATEST = "latest"
DIST_OPTIMIZER_STATE = "distributed_optimizer.pt"


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new content, never a mix."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save_training_checkpoint(root: str, step: int, policy: Policy, state: dict[str, Any], keep_last: int) -> str:
    """Save policy + optimizer + schedule + RNG + ``state`` (JSON-able) as ``root/step_{step}``; collective."""
    name = f"step_{step:08d}"
    final, partial = os.path.join(root, name), os.path.join(root, f"{name}.partial")
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(os.path.join(partial, "optim"), exist_ok=True)
    _barrier()
    save_model_weights(policy.module, os.path.join(partial, "weights"), policy.model_config)
    torch.save({"optimizer": policy.optimizer.state_dict(), "scheduler": policy.scheduler.state_dict(),
                "rng": _rng_state()}, os.path.join(partial, "optim", f"rank_{_rank():05d}.pt"))
    if policy.parallel.use_distributed_optimizer:
        # The distributed optimizer keeps Adam moments and fp32 master weights out of state_dict().
        policy.optimizer.save_parameter_state(os.path.join(partial, "optim", DIST_OPTIMIZER_STATE))
    _barrier()
    if _rank() == 0:
        with open(os.path.join(partial, "state.json"), "w") as f:
            json.dump({"step": step, **state}, f, indent=2, sort_keys=True)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        write_atomically(os.path.join(root, LATEST), name)
        _prune(root, keep_last)
    _barrier()
    return final


def _prune(root: str, keep_last: int) -> None:
    for stale in (d for d in os.listdir(root) if d.endswith(".partial")):
        shutil.rmtree(os.path.join(root, stale), ignore_errors=True)  # left by a crash mid-save
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".partial"))
    latest = read_latest(root)
    for old in steps[:-keep_last] if keep_last > 0 else []:
        if os.path.join(root, old) != latest:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json"))


def read_latest(root: str) -> Optional[str]:
    """The folder of the last complete checkpoint under ``root``, or None.

    Follows the ``latest`` pointer; if what it names is gone or incomplete (a folder removed by
    hand, a file system that lost the rename), falls back to the newest complete ``step_*``.
    """
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if _complete(path):
            return path
    if not os.path.isdir(root):
        return None
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".partial"))
    complete = [os.path.join(root, d) for d in steps if _complete(os.path.join(root, d))]
    return complete[-1] if complete else None


def load_training_checkpoint(path: str, policy: Policy) -> dict[str, Any]:
    """Restore policy, optimizer, schedule and RNG from ``path``; returns its ``state.json``; collective."""
    load_model_weights(policy.module, os.path.join(path, "weights"), policy.model_config)
    optim_file = os.path.join(path, "optim", f"rank_{_rank():05d}.pt")
    if not os.path.isfile(optim_file):
        raise RuntimeError(f"{optim_file} is missing: resume needs the parallel layout (world size) the "
                           "checkpoint was written with; its weights/ load at any layout")
    saved = torch.load(optim_file, weights_only=False)
    policy.optimizer.load_state_dict(saved["optimizer"])
    if policy.parallel.use_distributed_optimizer:
        policy.optimizer.load_parameter_state(os.path.join(path, "optim", DIST_OPTIMIZER_STATE))
    policy.scheduler.load_state_dict(saved["scheduler"])
    _set_rng_state(saved["rng"])
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)


def save_final_weights(path: str, policy: Policy, extra_files: dict[str, str]) -> None:
    """A stage's final weights (what later stages start from and MOPD teachers load), atomically."""
    partial = f"{path}.partial"
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    _barrier()
    save_model_weights(policy.module, partial, policy.model_config)
    if _rank() == 0:
        for name, text in extra_files.items():
            with open(os.path.join(partial, name), "w") as f:
                f.write(text)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(partial, path)
    _barrier()
