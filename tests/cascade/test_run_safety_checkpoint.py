"""Training checkpoints survive a damaged latest one, and are on stable storage before ``latest`` moves.

* A truncated (or missing) file in the latest checkpoint: ``read_latest`` warns, naming the file, and
  returns the previous intact checkpoint, which loads (before: it returned the damaged one and the
  resume failed inside Megatron's loader).
* Every file and folder of a checkpoint has been fsynced when the ``latest`` pointer is replaced
  (before: ``state.json``, the RNG files, ``common.pt``, ``metadata.json`` and ``model_config.json``
  were not, nor any directory entry).
* After a fallback, the next save removes the damaged newer checkpoint (an abandoned future).
"""

from __future__ import annotations

import logging
import os

import pytest

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.training import OptimizerConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, ffn_hidden_size=64)


def _policy():
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import build_policy

    initialize_model_parallel(ParallelConfig(), seed=5)
    return build_policy(MODEL, ParallelConfig(), OptimizerConfig(), total_steps=4)


def _largest_file(folder: str) -> str:
    files = [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]
    return max(files, key=os.path.getsize)


def _fallback_worker(root: str, damage: str) -> dict:
    from megatron_cascade.training.checkpoint import load_training_checkpoint, read_latest, save_training_checkpoint

    policy = _policy()
    for step in (1, 2):
        save_training_checkpoint(root, step, policy, {"stage": "s"}, keep_last=2)
    victim = _largest_file(os.path.join(root, "step_00000002", "optim"))
    if damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    else:
        os.remove(victim)
    latest = read_latest(root)
    state = load_training_checkpoint(latest, policy)
    # The run goes on from step 1 and saves step 2 again: the damaged one is replaced; its newer
    # leftovers (none here) would be removed.
    save_training_checkpoint(root, 2, policy, {"stage": "s"}, keep_last=2)
    return {"latest": latest, "step": state["step"], "victim": os.path.relpath(victim, root),
            "after": read_latest(root), "dirs": sorted(os.listdir(root))}


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    root = str(tmp_path / "ckpt")
    result = run_distributed(_fallback_worker, 1, root, damage)[0]
    assert result["latest"] == os.path.join(root, "step_00000001"), result
    assert result["step"] == 1
    assert result["after"] == os.path.join(root, "step_00000002")
    assert result["dirs"] == ["latest", "step_00000001", "step_00000002"]


def _warning_worker(root: str) -> str:
    """The warning's text, captured in the worker (its log records do not reach the parent)."""
    from megatron_cascade.training.checkpoint import read_latest, save_training_checkpoint

    policy = _policy()
    for step in (1, 2):
        save_training_checkpoint(root, step, policy, {}, keep_last=2)
    victim = _largest_file(os.path.join(root, "step_00000002", "weights"))
    with open(victim, "r+b") as f:
        f.truncate(10)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("megatron_cascade.training").addHandler(handler)
    assert read_latest(root) == os.path.join(root, "step_00000001")
    return "\n".join(records) + f"\nVICTIM {os.path.relpath(victim, os.path.join(root, 'step_00000002'))}"


def test_the_fallback_warning_names_the_damaged_file_and_the_checkpoint_used(tmp_path):
    root = str(tmp_path / "ckpt")
    text = run_distributed(_warning_worker, 1, root)[0]
    victim = text.rsplit("VICTIM ", 1)[1]
    assert f"{os.path.join(root, 'step_00000002')} is damaged" in text, text
    assert f"{victim}: 10 bytes" in text, text
    assert f"resuming from the previous intact checkpoint {os.path.join(root, 'step_00000001')}" in text, text


def _fsync_worker(root: str) -> dict:
    """Record every fsync (by path) and when ``latest`` is replaced, around a real save."""
    from megatron_cascade.training.checkpoint import save_training_checkpoint

    policy = _policy()
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", os.fspath(dst)))
        return real_replace(src, dst, **kw)

    os.fsync, os.replace = fsync, replace
    try:
        save_training_checkpoint(root, 1, policy, {}, keep_last=2)
    finally:
        os.fsync, os.replace = real_fsync, real_replace
    final = os.path.join(root, "step_00000001")
    paths = [os.path.join(d, f) for d, _, names in os.walk(final) for f in names]
    paths += [d for d, _, _ in os.walk(final)]
    return {"events": events, "paths": paths}


def test_every_checkpoint_file_and_folder_is_fsynced_before_latest_moves(tmp_path):
    root = str(tmp_path / "ckpt")
    result = run_distributed(_fsync_worker, 1, root)[0]
    events = result["events"]
    moved = next(i for i, (kind, path) in enumerate(events) if kind == "replace" and path.endswith("/latest"))
    partial, final = os.path.join(root, "step_00000001.partial"), os.path.join(root, "step_00000001")
    synced = {path.replace(partial, final) for kind, path in events[:moved] if kind == "fsync"}
    missing = sorted(os.path.relpath(p, root) for p in result["paths"] if p not in synced)
    assert not missing, f"not fsynced before latest moved: {missing}"
    assert root in synced  # the folder holding the renamed checkpoint
