"""Peak memory and time: vocab_parallel_logprobs vs naive log_softmax + gather (fp32, one process),
and what the sampler's top-k / top-p truncation costs the trainer (vocab_parallel_truncated_logprobs,
top_k=50, top_p=0.9, against the untruncated op).

Each variant runs in a fresh child process (so its RSS high-water mark is its own): the child builds
the logits, notes its RSS, runs the op ``--repeats`` times and reports the extra peak RSS over that
baseline and the median time. Usage: ``python benchmarks/logprobs.py [--tokens 8192 --vocab 65536]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time

import psutil
import torch


def _naive(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _ours(logits, targets):
    from megatron_cascade.ops import vocab_parallel_logprobs

    return vocab_parallel_logprobs(logits, targets)


def _truncated(logits, targets):
    from megatron_cascade.ops import vocab_parallel_truncated_logprobs

    return vocab_parallel_truncated_logprobs(logits, targets, top_k=50, top_p=0.9)[0]


def _child(name: str, backward: bool, tokens: int, vocab: int, repeats: int, out) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    fn = {"naive": _naive, "ours": _ours, "truncated": _truncated}[name]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=gen).requires_grad_(backward)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    fn(logits[:8], targets[:8])  # warm-up (imports, allocator) before the baseline
    baseline = psutil.Process().memory_info().rss
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        lp = fn(logits, targets)
        if backward:
            lp.sum().backward()
            logits.grad = None
        times.append(time.perf_counter() - start)
        del lp
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.put((max(0, peak - baseline), statistics.median(times)))


def measure(name: str, backward: bool, tokens: int, vocab: int, repeats: int) -> tuple[int, float]:
    """(extra peak bytes, median seconds) of one variant, measured in a fresh process."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, backward, tokens, vocab, repeats, out))
    proc.start()
    result = out.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    print(f"logits: {args.tokens} tokens x {args.vocab} vocab, fp32 = {logits_mb:.0f} MiB; "
          f"threads={torch.get_num_threads()}")
    print(f"{'pass':<14}{'naive MiB':>12}{'ours MiB':>12}{'mem ratio':>11}{'naive s':>10}{'ours s':>10}{'time ratio':>12}")
    for backward in (False, True):
        naive_mem, naive_t = measure("naive", backward, args.tokens, args.vocab, args.repeats)
        ours_mem, ours_t = measure("ours", backward, args.tokens, args.vocab, args.repeats)
        label = "fwd+bwd" if backward else "fwd"
        print(f"{label:<14}{naive_mem / 2**20:>12.0f}{ours_mem / 2**20:>12.0f}{ours_mem / max(naive_mem, 1):>11.2f}"
              f"{naive_t:>10.3f}{ours_t:>10.3f}{ours_t / naive_t:>12.2f}")
    print("MiB = peak RSS above the process's RSS with the logits allocated (fwd+bwd includes the "
          "logits gradient, which both must produce).")
    print(f"\n{'top-k/top-p':<14}{'plain MiB':>12}{'trunc MiB':>12}{'mem ratio':>11}{'plain s':>10}{'trunc s':>10}"
          f"{'time ratio':>12}")
    for backward in (False, True):
        plain_mem, plain_t = measure("ours", backward, args.tokens, args.vocab, args.repeats)
        trunc_mem, trunc_t = measure("truncated", backward, args.tokens, args.vocab, args.repeats)
        label = "fwd+bwd" if backward else "fwd"
        print(f"{label:<14}{plain_mem / 2**20:>12.0f}{trunc_mem / 2**20:>12.0f}{trunc_mem / max(plain_mem, 1):>11.2f}"
              f"{plain_t:>10.3f}{trunc_t:>10.3f}{trunc_t / plain_t:>12.2f}")
    print("truncation sorts each token's distribution over the whole vocabulary (top-p needs it): the "
          "price of training on the distribution actually sampled from.")


if __name__ == "__main__":
    main()
