"""Training checkpoints survive a damaged latest one, and are on stable storage before ``latest`` moves.

* A truncated (or missing) file in the latest checkpoint: ``read_latest`` warns, naming the file, and
  returns the previous intact checkpoint, which loads (before: it returned the damaged one and the
  resume failed inside Megatron's loader).
* Every file and folder of a checkpoint has been fsynced when the ``latest`` pointer is replaced
  (before: ``state.json``, the RNG files, ``common.pt``, ``metadata.json`` and ``model_config.json``
  were not, nor any directory entry).
* After a fallback, the next save removes the damaged newer checkpoint (an abandoned future), so
  that ``keep_last`` keeps intact ones (before: steps 3 and damaged 4 were kept, intact 2 deleted).
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


def _damage_and_resume(root: str, policy, damaged: int, damage: str) -> dict:
    """Damage the largest file of a checkpoint's optimizer state, resume as the stage does (read_latest,
    load), and save the next step, as a run stopped by its time limit right after it would."""
    from megatron_cascade.training.resume_checkpoint import load_training_checkpoint, read_latest, save_training_checkpoint

    victim = _largest_file(os.path.join(root, f"step_{damaged:08d}", "optim"))
    if damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(10)
    else:
        os.remove(victim)
    latest = read_latest(root)
    state = load_training_checkpoint(latest, policy)
    save_training_checkpoint(root, state["step"] + 1, policy, {"stage": "s"}, keep_last=2)
    return {"latest": latest, "step": state["step"], "victim": os.path.relpath(victim, root),
            "after": read_latest(root), "dirs": sorted(os.listdir(root))}


def _fallback_worker(root: str) -> dict:
    from megatron_cascade.training.resume_checkpoint import save_training_checkpoint

    policy = _policy()
    for step in (2, 4):  # checkpoint.every_steps=2
        save_training_checkpoint(root, step, policy, {"stage": "s"}, keep_last=2)
    warnings: list[str] = []  # the worker's log records do not reach the test process
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("megatron_cascade.training").addHandler(handler)
    truncated = _damage_and_resume(root, policy, 4, "truncate")  # resumes at 2, saves 3
    removed = _damage_and_resume(root, policy, 3, "remove")  # resumes at 2, saves 3 again
    return {"truncate": truncated, "remove": removed, "warnings": warnings}


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one_with_a_warning(tmp_path):
    root = str(tmp_path / "ckpt")
    result = run_distributed(_fallback_worker, 1, root)[0]
    previous = os.path.join(root, "step_00000002")
    for kind in ("truncate", "remove"):
        case = result[kind]
        assert case["latest"] == previous and case["step"] == 2, case
        # The damaged step 4 (newer than the new latest) is gone; keep_last=2 kept the intact step 2.
        assert case["after"] == os.path.join(root, "step_00000003"), case
        assert case["dirs"] == ["latest", "step_00000002", "step_00000003"], case
    first, second = result["warnings"]
    truncated = os.path.relpath(result["truncate"]["victim"], "step_00000004")
    removed = os.path.relpath(result["remove"]["victim"], "step_00000003")
    step_4, step_3 = os.path.join(root, "step_00000004"), os.path.join(root, "step_00000003")
    assert first.startswith(f"checkpoint {step_4} is damaged ({truncated}: 10 bytes, "), first
    assert second.startswith(f"checkpoint {step_3} is damaged ({removed} is missing)"), second
    for warning in (first, second):
        assert warning.endswith(f"resuming from the previous intact checkpoint {previous} instead"), warning


def _fsync_worker(root: str) -> dict:
    """Record every fsync (by path) and when ``latest`` is replaced, around a real save."""
    from megatron_cascade.training.resume_checkpoint import save_training_checkpoint

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


def _agreement_worker(root: str, blind_rank: int) -> dict:
    """Rank 1's file-system view lags (its ``read_latest`` finds nothing yet); with ``blind_rank`` it
    cannot see the checkpoint at all. Returns each rank's own answer and the agreed one (or the error)."""
    import torch.distributed as dist

    from megatron_cascade.model import CheckpointError
    from megatron_cascade.training import resume_checkpoint as checkpoint

    if dist.get_rank() == 0:
        os.makedirs(os.path.join(root, "step_000002"))
        with open(os.path.join(root, "step_000002", "state.json"), "w") as f:
            f.write('{"step": 2, "files": {}}')
        with open(os.path.join(root, "latest"), "w") as f:
            f.write("step_000002")
    dist.barrier()
    if dist.get_rank() == 1:  # a node whose view of the shared file system lags
        checkpoint.read_latest = lambda root, rejected=(): None
    if dist.get_rank() == blind_rank:
        checkpoint._complete = lambda path: False
    own = checkpoint.read_latest(root)
    try:
        agreed = checkpoint.agreed_latest(root)
    except CheckpointError as exc:
        agreed = f"CheckpointError: {exc}"
    return {"own": own, "agreed": agreed}


def test_every_rank_resumes_from_the_checkpoint_rank_0_chose(tmp_path):
    """Before: each rank took ``read_latest`` of its own view, so a node whose file system lagged
    started the stage over while the others resumed at step 2. Now rank 0 decides for all; a rank
    that cannot see its choice stops every rank with an error naming it."""
    root = str(tmp_path / "ck")
    ranks = run_distributed(_agreement_worker, 2, root, -1)
    assert [r["own"] for r in ranks] == [os.path.join(root, "step_000002"), None]  # what each saw alone
    assert [r["agreed"] for r in ranks] == [os.path.join(root, "step_000002")] * 2
    blind = run_distributed(_agreement_worker, 2, str(tmp_path / "ck2"), 1)
    for result in blind:
        assert result["agreed"].startswith("CheckpointError: rank 0 resumes from") and "ranks [1]" in result["agreed"]


def _nonfinite_worker(root: str) -> dict:
    """At TP=2 (each rank holds half of linear_fc1): seal the final weights of a healthy policy, then of
    one whose shard on rank 1 holds a NaN."""
    import torch
    import torch.distributed as dist

    from megatron_cascade.model import CheckpointError, initialize_model_parallel
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import save_final_weights
    from megatron_cascade.training.policy import unwrap

    layout = ParallelConfig(tensor_model_parallel_size=2)
    initialize_model_parallel(layout, seed=5)
    policy = build_policy(MODEL, layout, OptimizerConfig(), total_steps=4)
    save_final_weights(os.path.join(root, "healthy"), policy, {})
    if dist.get_rank() == 1:
        with torch.no_grad():
            unwrap(policy.module).decoder.layers[0].mlp.linear_fc1.weight.view(-1)[3] = float("nan")
    try:
        save_final_weights(os.path.join(root, "final"), policy, {})
        outcome = "sealed"
    except CheckpointError as exc:
        outcome = f"CheckpointError: {exc}"
    return {"outcome": outcome, "dirs": sorted(os.listdir(root))}


def test_nonfinite_weights_are_never_sealed(tmp_path):
    """Before: a stage whose weights went NaN (here: one element of one rank's shard) sealed them as its
    final weights and handed them to the next stage and to MOPD. Now every rank refuses, naming the
    tensor, and no final folder appears."""
    root = str(tmp_path / "stage")
    os.makedirs(root)
    for result in run_distributed(_nonfinite_worker, 2, root):
        assert result["outcome"].startswith("CheckpointError: refusing to seal"), result
        assert "decoder.layers.0.mlp.linear_fc1.weight" in result["outcome"], result
        assert result["dirs"] == ["healthy"], result


WIDE = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=4096, ffn_hidden_size=128)


def _scribble(path: str) -> None:
    """64 KiB of garbage in the middle of ``path``, its size unchanged."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(os.urandom(64 << 10))


def _largest_shard_of(folder: str, rank: int | None = None) -> str:
    shards = [os.path.join(folder, name) for name in os.listdir(folder)
              if name.endswith(".distcp") and (rank is None or name.startswith(f"__{rank}_"))]
    return max(shards, key=os.path.getsize)


def _every_byte_worker(root: str) -> dict:
    """DP=2: save steps 2 and 4 and final weights; scribble inside rank 1's largest optimizer shard of
    step 4 and inside a weights shard of the final folder; resume and load as a stage would."""
    import torch.distributed as dist

    from megatron_cascade.model import CheckpointError, initialize_model_parallel, load_model_weights
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import agreed_latest, save_final_weights, save_training_checkpoint

    initialize_model_parallel(ParallelConfig(), seed=5)
    policy = build_policy(WIDE, ParallelConfig(), OptimizerConfig(), total_steps=4)
    for step in (2, 4):
        save_training_checkpoint(root, step, policy, {"stage": "s"}, keep_last=2)
    final = os.path.join(root, "final")
    save_final_weights(final, policy, {"note.txt": "x\n"})
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("megatron_cascade.training").addHandler(handler)
    victim = _largest_shard_of(os.path.join(root, "step_00000004", "optim"), rank=1)
    weights_victim = _largest_shard_of(final)  # replicas: rank 0 wrote them
    dist.barrier()
    if dist.get_rank() == 0:
        _scribble(victim)
        _scribble(weights_victim)
    dist.barrier()
    latest = agreed_latest(root)
    try:
        load_model_weights(policy.module, final, WIDE)
        loaded = "loaded"
    except CheckpointError as exc:
        loaded = f"CheckpointError: {exc}"
    return {"latest": latest, "victim": victim, "victim_bytes": os.path.getsize(victim),
            "weights_victim": weights_victim, "loaded": loaded, "warnings": warnings}


def test_a_changed_byte_in_any_file_is_found_by_the_rank_that_wrote_it(tmp_path):
    """Before: only files up to 1 MiB were hashed; 64 KiB of garbage inside a large optimizer shard
    was resumed from (a stage then ended in NaN weights), and a final-weights shard carried no record
    at all. Now every file is hashed at save (each rank its own shards) and verified at resume and at
    every load: the resume falls back to step 2 with a warning, the load is refused naming the file."""
    root = str(tmp_path / "ckpt")
    ranks = run_distributed(_every_byte_worker, 2, root)
    step_2, step_4 = os.path.join(root, "step_00000002"), os.path.join(root, "step_00000004")
    victim = os.path.relpath(ranks[0]["victim"], step_4)
    assert ranks[0]["victim_bytes"] > 1 << 20, ranks[0]  # larger than any file the old record hashed
    for result in ranks:
        assert result["latest"] == step_2, result
        shard = os.path.basename(result["weights_victim"])
        assert result["loaded"].startswith(f"CheckpointError: checkpoint {root}/final is damaged: {shard}: content "
                                           "differs from what was written (xxh3_128)"), result
    assert ranks[0]["warnings"] == [f"checkpoint {step_4} is damaged ({victim}: content differs from what was "
                                    "written (xxh3_128)); looking for the previous intact checkpoint"], ranks[0]
    assert ranks[1]["warnings"] == []
