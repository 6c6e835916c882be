"""Tokens/s of one GRPO training step: TP=1 vs TP=2, ours vs a naive log-prob path, on CPU; and
padded vs packed rows, with and without activation recompute (``--only packing``).

"ours" computes token log-probs with ``ops.vocab_parallel_logprobs`` on the vocab-sharded logits;
"naive" gathers the full logits over TP and runs ``log_softmax(...).gather`` in float32 (what many
RL stacks do). Every configuration runs in the same script on gloo worker processes, warm-up step
excluded. Usage: ``python benchmarks/train_step.py [--steps 3] [--only logprobs|packing]``.

The packing section runs the tiny long-context model of ``examples/tiny_cascade/long.yaml`` (2 layers,
hidden 128) on two batches of 16 sequences: lengths spread over 64..1024 tokens (loss on the last
quarter of each), and long.yaml's rows (1,000-2,008 tokens: prompt + 8 response tokens). Padded:
micro-batches of 4 rows cut at the longest loss position (today's path). Packed: rows of 4,096 /
8,192 tokens (``training.sequence_packing``). Each configuration runs in a fresh process: "peak MiB"
is the growth of the process's peak RSS over the steps (warm-up included), above the built model
and optimizer; "tokens" counts every position the step runs, padding included.
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import replace

import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed

MODEL = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                    vocab_size=32000, ffn_hidden_size=704)
BATCH, SEQ = 8, 256


def _naive_token_logprobs(logits, targets, spec, tp_group):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits) if tp_group is not None else logits
    full = full[..., : spec.vocab_size].float() / spec.temperature
    return torch.log_softmax(full, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _bench_worker(tp: int, naive: bool, steps: int):
    import psutil

    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, TrainBatch, build_policy, train_step
    from megatron_cascade.training import loss_plugin

    if naive:
        loss_plugin.token_logprobs = _naive_token_logprobs
    parallel = ParallelConfig(tensor_model_parallel_size=tp)
    initialize_model_parallel(parallel, seed=0)
    policy = build_policy(MODEL, parallel, OptimizerConfig(lr=1e-5), total_steps=steps + 1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1), generator=gen)
    mask = torch.zeros(BATCH, SEQ)
    mask[:, SEQ // 4:] = 1
    batch = TrainBatch(ids[:, :-1], ids[:, 1:], mask, advantages=torch.randn(BATCH, generator=gen),
                       inference_logprobs=torch.full((BATCH, SEQ), -10.0))
    # Both rows compare log-prob ops on materialised logits (the fused head would bypass token_logprobs:
    # benchmarks/logprobs.py --only step measures it).
    spec = LossSpec("grpo", LossConfig(), vocab_size=MODEL.vocab_size, output_head="logits")
    training = TrainingConfig(micro_batch_size=4)
    train_step(policy, batch, spec, training)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        train_step(policy, batch, spec, training)
    seconds = (time.perf_counter() - start) / steps
    peak_mib = psutil.Process().memory_info().rss / 2**20
    return seconds, peak_mib


LONG_MODEL = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                         num_query_groups=2, vocab_size=103, max_position_embeddings=2048)
PACKED_BATCHES = {"64..1024": (64, 1024, 0.25, 4096), "long.yaml": (1000, 2008, 8, 8192)}


def _spread_batch(low: int, high: int, response, rows: int = 16):
    """``rows`` sequences of lengths uniform in [low, high], right-padded; the loss on the last
    ``response`` tokens (a fraction of each length, or a count)."""
    from megatron_cascade.training import TrainBatch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(low, high + 1, (rows,), generator=gen)
    width = int(lengths.max())
    ids = torch.randint(0, LONG_MODEL.vocab_size, (rows, width + 1), generator=gen)
    mask = torch.zeros(rows, width)
    for row, n in enumerate(lengths.tolist()):
        tail = int(n * response) if isinstance(response, float) else response
        mask[row, n - tail:n] = 1
    return TrainBatch(ids[:, :-1], ids[:, 1:], mask, advantages=torch.randn(rows, generator=gen),
                      inference_logprobs=torch.full((rows, width), -5.0))


def _packing_worker(batch_name: str, packed: bool, recompute: str, steps: int):
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, build_policy, train_step
    from megatron_cascade.training.packing import sequence_lengths
    from megatron_cascade.training.step import _training_micro_batches

    low, high, response, budget = PACKED_BATCHES[batch_name]
    model = replace(LONG_MODEL, recompute=recompute)
    parallel = ParallelConfig()
    initialize_model_parallel(parallel, seed=0)
    policy = build_policy(model, parallel, OptimizerConfig(lr=1e-5), total_steps=steps + 1)
    batch = _spread_batch(low, high, response)
    spec = LossSpec("grpo", LossConfig(), vocab_size=model.vocab_size)
    training = TrainingConfig(micro_batch_size=4, sequence_packing=packed,
                              max_tokens_per_row=budget if packed else None)
    tokens = sum(m.input_ids.numel() for m in _training_micro_batches(policy, batch, training))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train_step(policy, batch, spec, training)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        train_step(policy, batch, spec, training)
    seconds = (time.perf_counter() - start) / steps
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss: KiB on Linux
    real = int(sequence_lengths(batch).sum())  # tokens of the sequences themselves
    return tokens, real, seconds, peak_mib


def packing_section(steps: int) -> None:
    print(f"\npacking: {LONG_MODEL.num_layers} layers, hidden {LONG_MODEL.hidden_size}, fp32, 16 sequences, "
          f"micro_batch_size 4, 1 process")
    print(f"{'batch':<11}{'rows':<8}{'recompute':<11}{'tokens':>8}{'real':>8}{'s/step':>9}{'peak MiB':>10}")
    for batch_name in PACKED_BATCHES:
        for recompute in ("none", "full"):
            for packed in (False, True):
                tokens, real, seconds, peak = run_distributed(_packing_worker, 1, batch_name, packed, recompute, steps,
                                                              timeout_s=1800)[0]
                print(f"{batch_name:<11}{'packed' if packed else 'padded':<8}{recompute:<11}{tokens:>8}{real:>8}"
                      f"{seconds:>9.2f}{peak:>10.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", choices=("logprobs", "packing"), default=None)
    args = parser.parse_args()
    if args.only != "logprobs":
        packing_section(args.steps)
    if args.only == "packing":
        return
    tokens = BATCH * SEQ
    print(f"model: {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, vocab {MODEL.vocab_size}; "
          f"step = {BATCH} x {SEQ} tokens, fp32, gloo on {torch.get_num_threads()} cores")
    print(f"{'layout':<8}{'path':<8}{'s/step':>10}{'tokens/s':>11}{'RSS MiB/rank':>14}")
    for tp in (1, 2):
        for naive in (False, True):
            results = run_distributed(_bench_worker, tp, tp, naive, args.steps, timeout_s=1800)
            seconds = max(r[0] for r in results)
            rss = max(r[1] for r in results)
            print(f"{'TP=' + str(tp):<8}{'naive' if naive else 'ours':<8}{seconds:>10.3f}{tokens / seconds:>11.0f}"
                  f"{rss:>14.0f}")


if __name__ == "__main__":
    main()
