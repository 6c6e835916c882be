"""Peak memory and time: vocab_parallel_logprobs vs naive log_softmax + gather (fp32, one process),
and what the sampler's top-k / top-p truncation costs the trainer (vocab_parallel_truncated_logprobs,
top_k=50, top_p=0.9, against the untruncated op).

Each variant runs in a fresh child process (so its RSS high-water mark is its own): the child builds
the logits, notes its RSS, runs the op ``--repeats`` times and reports the extra peak RSS over that
baseline and the median time. Usage: ``python benchmarks/logprobs.py [--tokens 8192 --vocab 65536]``.

``--only fused`` measures fused_output_logprobs (output layer + log-probs, chunked, logits recomputed
in backward) against the naive path (logits = hidden @ W.T, log_softmax, gather) from hidden states
[tokens, --hidden] and a weight [vocab, --hidden], fp32: peak above the inputs and median time, values
and gradients compared; then at TP=2 (two gloo processes, each its vocabulary half of the weight)
against Megatron-Core's vocab_parallel_cross_entropy on each rank's materialised logits.

``--only step`` measures one training step (``train_step``: forward, backward, optimizer) of a small
GPT with a large vocabulary (``--step-layers`` x ``--step-hidden``, vocab ``--vocab``, one sequence of
``--step-seq`` tokens, fp32, one gloo process) with the fused log-prob head (``LossSpec.output_head=
"fused"``) and with the logits path (``"logits"``): peak RSS above the process's RSS after a warm-up
step on a short batch (parameters, gradient buffers and Adam state allocated), each head alone in a
fresh process; time, the two heads alternating in one process; loss and gradient norm compared.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time

import psutil
import torch
import torch.distributed as dist


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


def _fused_inputs(tokens: int, hidden: int, vocab: int, backward: bool, rank: int = 0, world: int = 1):
    """hidden [tokens, hidden], this rank's weight rows [vocab / world, hidden] (fp32), targets [tokens]."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_(backward)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).chunk(world)[rank].clone().requires_grad_(backward)
    return h, w, torch.randint(0, vocab, (tokens,), generator=gen)


def _fused_variant(name: str, group):
    """log-probs [tokens] from (hidden, weight shard, targets) by the named path."""
    from megatron_cascade.ops import fused_output_logprobs

    if name == "fused":
        return lambda h, w, t: fused_output_logprobs(h, w, t, group=group)
    if group is None:
        return lambda h, w, t: torch.log_softmax(h @ w.t(), dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, vocab_parallel_cross_entropy

    # as ColumnParallelLinear: the replicated input's gradient is all-reduced over the TP group
    return lambda h, w, t: -vocab_parallel_cross_entropy(copy_to_tensor_model_parallel_region(h) @ w.t(), t)


def _fused_measure(name: str, backward: bool, tokens: int, hidden: int, vocab: int, repeats: int, group=None):
    """(extra peak bytes over the inputs, median seconds, last log-probs, grad hidden, grad weight)."""
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    fn = _fused_variant(name, group)
    h, w, targets = _fused_inputs(tokens, hidden, vocab, backward, rank, world)
    small = fn(h[:8], w, targets[:8])  # warm-up (imports, allocator) before the baseline
    if backward:
        small.sum().backward()
        h.grad = w.grad = None
    del small
    baseline = psutil.Process().memory_info().rss
    times = []
    for _ in range(repeats):
        h.grad = w.grad = None
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        lp = fn(h, w, targets)
        if backward:
            lp.sum().backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # numpy copies travel by value (a tensor would travel as a shared-memory handle of an exited process)
    arrays = [None if t is None else t.detach().numpy() for t in (lp, h.grad, w.grad)]
    return (max(0, peak - baseline), statistics.median(times), *arrays)


def _fused_timing(order: tuple, backward: bool, tokens: int, hidden: int, vocab: int, repeats: int, group=None):
    """{name: median seconds}, the variants alternating in one process: on a machine shared with other
    work, both then see the same load (separate processes minutes apart did not: 0.98x and 2.04x)."""
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    h, w, targets = _fused_inputs(tokens, hidden, vocab, backward, rank, world)
    fns = {name: _fused_variant(name, group) for name in order}
    times = {name: [] for name in order}
    for _ in range(repeats + 1):  # the first round warms up (page faults of first use)
        for name in order:
            h.grad = w.grad = None
            if group is not None:
                dist.barrier(group)
            start = time.perf_counter()
            lp = fns[name](h, w, targets)
            if backward:
                lp.sum().backward()
            times[name].append(time.perf_counter() - start)
            del lp
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def _fused_child(task: str, *args) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = args[-1]
    out.put(_fused_measure(*args[:-1]) if task == "memory" else _fused_timing(*args[:-1]))


def _fused_tp_worker(task: str, *args):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    group = parallel_state.get_tensor_model_parallel_group()
    return _fused_measure(*args, group=group) if task == "memory" else _fused_timing(*args, group=group)


def _in_child(target, *args):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    result = out.get()
    proc.join()
    return result


def _max_diff(a, b) -> float:
    return float("nan") if a is None or b is None else float(abs(a - b).max())


def _fused_row(label: str, naive, fused, times: dict) -> str:
    """naive / fused: _fused_measure results (peak, -, log-probs, grads); times: _fused_timing's medians."""
    diffs = "  ".join(f"{n} {_max_diff(a, b):.1e}" for n, a, b in
                      (("lp", naive[2], fused[2]), ("dh", naive[3], fused[3]), ("dW", naive[4], fused[4])))
    return (f"{label:<14}{naive[0] / 2**20:>10.0f}{fused[0] / 2**20:>10.0f}{fused[0] / max(naive[0], 1):>11.3f}"
            f"{times['naive']:>10.2f}{times['fused']:>10.2f}{times['fused'] / times['naive']:>12.2f}   {diffs}")


def fused_section(tokens: int, hidden: int, vocab: int, repeats: int, tp: int, naive_first: bool) -> None:
    """fused_output_logprobs vs naive at TP=1 (one process each) and at TP=``tp`` (gloo processes)."""
    from megatron_cascade.testing import run_distributed

    order = ("naive", "fused") if naive_first else ("fused", "naive")
    print(f"\nfused output layer: hidden [{tokens}, {hidden}], weight [{vocab}, {hidden}] fp32 "
          f"(logits would be {tokens * vocab * 4 / 2**20:.0f} MiB); order: {' then '.join(order)}")
    header = (f"{'naive MiB':>10}{'fused MiB':>10}{'mem ratio':>11}{'naive s':>10}{'fused s':>10}"
              f"{'time ratio':>12}   max |naive - fused|")
    print(f"{'TP=1':<14}{header}")
    for backward in (False, True):
        res = {name: _in_child(_fused_child, "memory", name, backward, tokens, hidden, vocab, 1) for name in order}
        times = _in_child(_fused_child, "time", order, backward, tokens, hidden, vocab, repeats)
        print(_fused_row("fwd+bwd" if backward else "fwd", res["naive"], res["fused"], times))
    if tp > 1:
        print(f"{f'TP={tp} rank':<14}{header}  (naive: Megatron vocab_parallel_cross_entropy; dW: own shard)")
        for backward in (False, True):
            res = {name: run_distributed(_fused_tp_worker, tp, "memory", name, backward, tokens, hidden, vocab, 1,
                                         timeout_s=3600) for name in order}
            times = run_distributed(_fused_tp_worker, tp, "time", order, backward, tokens, hidden, vocab, repeats,
                                    timeout_s=3600)
            for rank in range(tp):
                label = f"{'fwd+bwd' if backward else 'fwd'} r{rank}"
                print(_fused_row(label, res["naive"][rank], res["fused"][rank], times[rank]))
    print("MiB = peak RSS above the process's RSS with the inputs allocated (fwd+bwd includes the gradients of "
          "hidden and weight, which both must produce), each variant alone in a fresh process; s = median wall "
          "time of one pass, the two variants alternating in one process (after a warm-up round).")


def _step_setup(layers: int, hidden: int, vocab: int, seq: int):
    """(policy, spec per head, batch of one ``seq``-token sequence, warm-up batch of 16 tokens)."""
    from megatron_cascade.config import ModelConfig, ParallelConfig
    from megatron_cascade.config.training import LossConfig, OptimizerConfig
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, TrainBatch, build_policy

    model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
                        ffn_hidden_size=4 * hidden, vocab_size=vocab, make_vocab_size_divisible_by=128,
                        max_position_embeddings=max(4096, seq))
    initialize_model_parallel(ParallelConfig(), seed=0)
    policy = build_policy(model, ParallelConfig(), OptimizerConfig(lr=1e-5), total_steps=100)

    def batch(length: int):
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(0, vocab, (1, length + 1), generator=gen)
        mask = torch.zeros(1, length)
        mask[:, length // 4:] = 1  # a prompt quarter, then the response
        return TrainBatch(ids[:, :-1], ids[:, 1:], mask, advantages=torch.ones(1),
                          inference_logprobs=torch.full((1, length), -10.0))

    specs = {head: LossSpec("grpo", LossConfig(), vocab_size=vocab, output_head=head) for head in ("logits", "fused")}
    return policy, specs, batch(seq), batch(16)


def _step_worker(task: str, heads: tuple, layers: int, hidden: int, vocab: int, seq: int, repeats: int):
    """memory: (extra peak bytes, loss, grad norm) of one step with heads[0]; time: {head: median s}."""
    from megatron_cascade.config.training import TrainingConfig
    from megatron_cascade.training import train_step

    torch.set_num_threads(max(1, torch.get_num_threads()))
    policy, specs, batch, warm = _step_setup(layers, hidden, vocab, seq)
    training = TrainingConfig(micro_batch_size=1)
    for head in heads:  # warm-up: Adam state, imports, both heads' code paths
        train_step(policy, warm, specs[head], training)
    if task == "memory":
        baseline = psutil.Process().memory_info().rss
        metrics = train_step(policy, batch, specs[heads[0]], training)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, peak - baseline), metrics["loss"], metrics["grad_norm"]
    times = {head: [] for head in heads}
    for _ in range(repeats):
        for head in heads:
            start = time.perf_counter()
            train_step(policy, batch, specs[head], training)
            times[head].append(time.perf_counter() - start)
    return {head: statistics.median(t) for head, t in times.items()}


def step_section(layers: int, hidden: int, vocab: int, seq: int, repeats: int) -> None:
    """One train_step of a small GPT, fused log-prob head vs the logits path (TP=1, fp32)."""
    from megatron_cascade.testing import run_distributed

    args = (layers, hidden, vocab, seq, repeats)
    print(f"\ntrain step: GPT {layers} layers x hidden {hidden}, vocab {vocab}, 1 x {seq} tokens, fp32, GRPO, TP=1 "
          f"(one copy of the logits: {seq * vocab * 4 / 2**20:.0f} MiB)")
    mem = {head: run_distributed(_step_worker, 1, "memory", (head,), *args, timeout_s=3600)[0]
           for head in ("logits", "fused")}
    times = run_distributed(_step_worker, 1, "time", ("logits", "fused"), *args, timeout_s=3600)[0]
    print(f"{'head':<8}{'peak MiB':>10}{'s/step':>9}{'loss':>14}{'grad norm':>14}")
    for head in ("logits", "fused"):
        extra, loss, norm = mem[head]
        print(f"{head:<8}{extra / 2**20:>10.0f}{times[head]:>9.2f}{loss:>14.7f}{norm:>14.7f}")
    ratio_mem = mem["fused"][0] / max(mem["logits"][0], 1)
    print(f"fused / logits: memory {ratio_mem:.3f}x, time {times['fused'] / times['logits']:.2f}x. MiB = peak RSS "
          "above the RSS after a warm-up step (each head alone in a fresh process); s = median wall time of a "
          "step, the heads alternating in one process (steps change the weights: losses are of the first step).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the fused section")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the fused section's second run "
                        "(1 = skip it)")
    parser.add_argument("--only", choices=("all", "logits", "fused", "step"), default="all",
                        help="logits: the sections on given logits; fused: fused_output_logprobs vs naive; "
                        "step: one training step, fused head vs logits path")
    parser.add_argument("--step-seq", type=int, default=2048, help="tokens of the step section's sequence")
    parser.add_argument("--step-layers", type=int, default=2)
    parser.add_argument("--step-hidden", type=int, default=256)
    parser.add_argument("--fused-first", action="store_true", help="run the fused variant before the naive one")
    args = parser.parse_args()
    if args.only in ("all", "step"):
        step_section(args.step_layers, args.step_hidden, args.vocab, args.step_seq, args.repeats)
    if args.only == "step":
        return
    if args.only in ("all", "fused"):
        fused_section(args.tokens, args.hidden, args.vocab, args.repeats, args.tp, not args.fused_first)
    if args.only == "fused":
        return
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
