"""The decode layout (``rollout.parallel``) on CPU, in one run of two gloo processes:

1. Refit: seconds per GB of ``DecodeCopy.refit`` (megatron-core's in-memory resharding, gloo) from a
   training layout of TP=2 and of PP=2 into a TP=1 copy, the plan's first refit and the cached ones,
   next to the on-paper time of the recipe's refit on NVLink and InfiniBand (bytes per GPU from the
   dry run's "decode layout" line).
2. Decoding: the same rollouts (64 requests, long-tailed lengths) generated at the training layout
   with two pipeline stages (the stages decode in series) and on the decode copy (two TP=1 replicas,
   each with half the prompts), tokens/s of the whole job (sampling noise is keyed by a prompt's
   index in its call, so the two runs draw different responses: each rate counts its own tokens).

Usage: ``python benchmarks/decode_layout.py [--hidden 512 --layers 8 --repeats 3]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.model import DecodeParallelConfig
from megatron_cascade.config.training import OptimizerConfig
from megatron_cascade.rollout import KVCacheConfig, SamplingParams, generate
from megatron_cascade.testing import run_distributed
from megatron_cascade.tokenizers import CharTokenizer

TOKENIZER = CharTokenizer()
STOP_IDS = (17, 42)
# On paper, per GPU (H100): NVLink 4 ~450 GB/s each way within a node; one 400 Gb/s InfiniBand NIC
# per GPU ~50 GB/s across nodes (the refit moves each GPU's share of the copy once per step).
NVLINK_GBPS, INFINIBAND_GBPS = 450.0, 50.0


def _model(hidden: int, layers: int) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=8, num_query_groups=4,
                       vocab_size=TOKENIZER.vocab_size, ffn_hidden_size=4 * hidden, max_position_embeddings=512,
                       init_method_std=0.05)


def _prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, TOKENIZER.vocab_size, (int(n),), generator=gen).tolist()
            for n in torch.randint(20, 61, (count,), generator=gen)]


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=128, seed=seed, stop_token_ids=STOP_IDS, ignore_eos=True)


def worker(model_cfg: ModelConfig, train: ParallelConfig, repeats: int, prompts: int) -> dict:
    """Refit timings, then decoding at the training layout and on the copy (one prompt per call
    seed, so both produce the same responses)."""
    import torch.distributed as dist

    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training.decode_copy import DecodeCopy
    from megatron_cascade.training.policy import build_policy

    torch.set_num_threads(1)
    initialize_model_parallel(train, seed=1)
    policy = build_policy(model_cfg, train, OptimizerConfig(lr=1e-3), total_steps=10)
    copy = DecodeCopy(model_cfg, DecodeParallelConfig())
    start = time.perf_counter()
    copy.refit(policy)
    first = time.perf_counter() - start
    cached = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy.refit(policy)
        cached.append(time.perf_counter() - start)
    out = {"first_s": first, "cached_s": min(cached), "copy_bytes": copy.refit_bytes}
    work = _prompts(prompts)
    kv = KVCacheConfig(kv_cache_bytes=2**30, block_size_tokens=64)
    timings = {}
    for name in ("training", "copy"):
        dist.barrier()
        start = time.perf_counter()
        if name == "training":  # one replica: both stages decode every prompt
            mine = range(len(work))
            model = policy.module
        else:  # two replicas, half the prompts each
            mine = range(copy.dp_rank, len(work), copy.dp_size)
            model = copy.module
        tokens = {}
        batch = generate(model, [work[i] for i in mine], _params(seed=7), tokenizer=TOKENIZER, kv_cache=kv)
        for i, sample in zip(mine, batch):
            tokens[i] = sample.response_ids
        dist.barrier()
        timings[name] = (time.perf_counter() - start, tokens)
    out["decode"] = timings
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()
    model_cfg = _model(args.hidden, args.layers)
    print(f"model: {args.layers} layers x {args.hidden} (fp32), 2 gloo processes on this machine's cores")
    print(f"{'training layout -> TP=1 copy':<30}{'copy MB/rank':>14}{'first refit s':>15}{'cached s':>10}{'s/GB':>8}")
    for label, train in (("TP=2", ParallelConfig(tensor_model_parallel_size=2)),
                         ("PP=2", ParallelConfig(pipeline_model_parallel_size=2))):
        ranks = run_distributed(worker, 2, model_cfg, train, args.repeats, args.prompts, timeout_s=3600)
        r = ranks[0]
        gb = r["copy_bytes"] / 1e9
        print(f"{label:<30}{r['copy_bytes'] / 1e6:>14.1f}{r['first_s']:>15.2f}{r['cached_s']:>10.3f}"
              f"{r['cached_s'] / gb:>8.2f}")
        if label == "PP=2":
            seconds = {name: max(rank["decode"][name][0] for rank in ranks) for name in ("training", "copy")}
            merged = {name: {} for name in ("training", "copy")}
            for rank in ranks:
                for name in merged:
                    merged[name].update(rank["decode"][name][1])
            rate = {name: sum(len(t) for t in merged[name].values()) / seconds[name] for name in seconds}
            print(f"decoding {args.prompts} prompts, up to 128 tokens each:")
            for name, label in (("training", "training layout PP=2 (stages in series)"),
                                ("copy", "decode layout TP=1 x DP=2 (the copy)")):
                tokens = sum(len(t) for t in merged[name].values())
                print(f"  {label:<42} {seconds[name]:6.2f} s, {tokens} tokens, {rate[name]:.0f} tokens/s")
            print(f"  decode layout / training layout: {rate['copy'] / rate['training']:.2f}x tokens/s")
    for name, path in RECIPES.items():
        gbytes, layout = recipe_refit_bytes(path)
        print(f"on paper, {name} (decode TP={layout.tp} EP={layout.ep}): {gbytes:.2f} GB per GPU per refit -> "
              f"{gbytes / NVLINK_GBPS * 1e3:.0f} ms over NVLink, {gbytes / INFINIBAND_GBPS * 1e3:.0f} ms over InfiniBand")


RECIPES = {"Nemotron-3-Nano recipe": "examples/nemotron_cascade2/nemotron_3_nano/cascade.yaml",
           "Qwen3-30B-A3B recipe": "examples/nemotron_cascade2/cascade.yaml"}


def recipe_refit_bytes(path: str):
    """(GB each GPU receives per refit, the decode layout) of a recipe's first RL stage, as its dry run
    plans them: the decode copy's parameters per GPU in the model dtype."""
    import os

    from megatron_cascade.cascade.plan import check_decode_layout, decode_copy_bytes
    from megatron_cascade.config import load_config, resolve_stage

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(repo, path), check_paths=False)
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    layout = check_decode_layout(cfg, resolve_stage(cfg, cfg.stages[0]), world)
    return decode_copy_bytes(cfg, layout) / 1e9, layout


if __name__ == "__main__":
    main()
