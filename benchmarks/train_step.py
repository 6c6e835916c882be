"""Tokens/s of one GRPO training step: TP=1 vs TP=2, ours vs a naive log-prob path, on CPU.

"ours" computes token log-probs with ``ops.vocab_parallel_logprobs`` on the vocab-sharded logits;
"naive" gathers the full logits over TP and runs ``log_softmax(...).gather`` in float32 (what many
RL stacks do). Every configuration runs in the same script on gloo worker processes, warm-up step
excluded. Usage: ``python benchmarks/train_step.py [--steps 3]``.
"""

from __future__ import annotations

import argparse
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
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
