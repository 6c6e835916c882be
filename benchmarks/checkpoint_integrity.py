"""What hashing every checkpoint file costs. Run: ``python benchmarks/checkpoint_integrity.py [--ranks 2]``.

Saves a training checkpoint of about 1 GiB (weights + Adam state of a ~90M-parameter fp32 model:
4 layers, hidden 1024, vocab 16000) with ``save_training_checkpoint`` as shipped (every file's
XXH3-128 hash, each rank hashing the shards it wrote) and, alternately in the same processes, with the
record reduced to sizes only (the baseline: what a save cost before). Then times a resume's full
verification (``agreed_latest``: every byte hashed, each rank its share) against the load that follows
(``load_training_checkpoint``). The first save of a process (Megatron's writer start-up) is excluded.
Figures are medians over ``--repeats`` saves of each kind; the folder lives under ``--dir`` (default: a
temporary folder on the disk of the working directory, where a run's output_dir would be).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.training import OptimizerConfig
from megatron_cascade.testing import run_distributed

MODEL = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=16000, ffn_hidden_size=4096)


def _sizes_only(folder: str):
    """The record without hashes (the baseline save); the same gather, so only the hashing differs."""
    from megatron_cascade.checkpoint_safety.integrity import files_under, owner_rank
    from megatron_cascade.model.weights_checkpoint import _gather, _rank, _world_size

    mine = {rel: {"bytes": os.path.getsize(os.path.join(folder, rel))} for rel in files_under(folder)
            if owner_rank(rel, _world_size()) == _rank()}
    shares = _gather(mine)
    return {rel: entry for share in shares for rel, entry in share.items()} if _rank() == 0 else None


def _worker(root: str, repeats: int) -> dict:
    import torch.distributed as dist

    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import build_policy, checkpoint

    initialize_model_parallel(ParallelConfig(), seed=0)
    policy = build_policy(MODEL, ParallelConfig(), OptimizerConfig(), total_steps=10)
    shipped = checkpoint.gathered_record
    times: dict[str, list[float]] = {"hashed": [], "sizes only": [], "hashing": []}

    def timed_record(folder: str):
        start = time.perf_counter()
        record = shipped(folder)
        times["hashing"].append(time.perf_counter() - start)
        return record

    step = 1
    checkpoint.save_training_checkpoint(root, step, policy, {"stage": "bench"}, keep_last=1)  # warm-up
    for _ in range(repeats):
        for kind in ("sizes only", "hashed") if step % 2 else ("hashed", "sizes only"):
            checkpoint.gathered_record = _sizes_only if kind == "sizes only" else timed_record
            step += 1
            dist.barrier()
            start = time.perf_counter()
            checkpoint.save_training_checkpoint(root, step, policy, {"stage": "bench"}, keep_last=1)
            times[kind].append(time.perf_counter() - start)
    checkpoint.gathered_record = shipped
    step += 1
    checkpoint.save_training_checkpoint(root, step, policy, {"stage": "bench"}, keep_last=1)
    dist.barrier()
    start = time.perf_counter()
    latest = checkpoint.agreed_latest(root)
    verify_s = time.perf_counter() - start
    start = time.perf_counter()
    checkpoint.load_training_checkpoint(latest, policy)
    load_s = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(latest) for n in names)
    return {"bytes": size, "save": {k: statistics.median(v) for k, v in times.items()},
            "verify_s": verify_s, "load_s": load_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=".")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        result = run_distributed(_worker, args.ranks, root, args.repeats, timeout_s=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = result["bytes"] / 2**30
    hashed, plain, hashing = (result["save"][k] for k in ("hashed", "sizes only", "hashing"))
    print(f"training checkpoint: {gib:.2f} GiB over {args.ranks} rank(s), {os.cpu_count()} cores")
    print(f"{'save':<28}{'seconds':>9}")
    print(f"{'  sizes only (baseline)':<28}{plain:>9.2f}")
    print(f"{'  every file hashed':<28}{hashed:>9.2f}   ({100 * (hashed - plain) / plain:+.1f}%)")
    print(f"{'    of which hashing':<28}{hashing:>9.2f}   {100 * hashing / hashed:.1f}% of the save, "
          f"{gib / hashing:.1f} GiB/s")
    print(f"{'resume':<28}")
    print(f"{'  verify every byte':<28}{result['verify_s']:>9.2f}   {gib / result['verify_s']:.2f} GiB/s")
    print(f"{'  load (weights + optimizer)':<28}{result['load_s']:>9.2f}   verification +"
          f"{100 * result['verify_s'] / result['load_s']:.0f}% of the load")


if __name__ == "__main__":
    main()
