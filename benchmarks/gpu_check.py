"""GPU check for the day a GPU is lent: the GPU paths the CPU harness cannot run, on ONE GPU, in minutes.

    python benchmarks/gpu_check.py [--json FILE] [--steps N] [--layers N --hidden N --seq N --batch N]
                                   [--slice-seqs N [N ...] --moe-set KEY=VALUE --hybrid-set KEY=VALUE]
    (or benchmarks/gpu_check.sh, which bounds it to 8 minutes)

Checks, most informative first, each printed as PASS / FAIL / SKIP with its figures (cpu_writer: the
CPU-side checkpoints the next checks load, written by a process without CUDA; if it fails they SKIP):
  moe_slice       the Qwen3-30B-A3B recipe's model cut to 4 layers (128 experts top-8, qk_layernorm, full
                  recompute, distributed optimizer with overlaps; grouped GEMM when TE): a training step
                  timed at 8K and 32K tokens, its peak memory against the dry run's formula for the same
                  shape (gpu_check_moe.py);
  hybrid_slice    the same for the Nemotron-3-Nano recipe's hybrid model at pattern MEM*E (Mamba-2, MoE
                  with its shared expert, attention);
  moe_checkpoint  a tiny MoE written on CPU (one weight per expert) loads into grouped experts (TE's
                  TEGroupedMLP when TE imports): logits agree at bf16 tolerance;
  cpu_checkpoint  a local-spec model written on CPU (a subprocess without CUDA, fp32) loads into the
                  GPU model (Transformer Engine spec when TE imports, else the local spec): logits agree
                  with the CPU model's at bf16 tolerance;
  bf16_step       training steps after loading those weights: the fp32 masters were reloaded (weights
                  after the steps stay near the loaded ones instead of snapping back to the build-time
                  init); step time, tokens/s, peak memory;
  optimizer_resume  a training checkpoint (weights, optimizer state — TE's FusedAdam when TE imports —,
                  schedule, RNG) saved, a step taken, the checkpoint loaded and the step redone: the
                  same weights bit for bit (where two redos of the step agree bit for bit; else within
                  their own spread: a non-deterministic backward kernel);
  training_state_offload  the grads and optimizer state parked in pinned host memory after a step
                  (rollout.offload_training_state): the device memory freed against their bytes, the
                  round trip's seconds, and the next step equal to the step without parking;
  fp8_step, fp8_resume, fp8_reference, fp8_generation
                  FP8 (hybrid, delayed scaling; TE only, else SKIP): steps, a checkpoint's FP8 scales
                  restored bit for bit, the bf16-GEMM frozen copy (KL reference, teachers) vs the FP8
                  policy, paged generation padded to FP8's multiples (gpu_check_fp8.py);
  fused_logprob_head  a train step's forward+backward with the fused log-prob head vs the logits path:
                  the same loss at a lower peak memory;
  packed_step     padding-free packed rows (THD, TE attention with cu_seqlens) vs the padded batch: the
                  same loss and gradient at bf16 tolerance, fewer tokens run;
  generation      sampling with Megatron's static KV cache; new tokens/s;
  nemotron_h_te   a tiny random Nemotron-H converted on CPU loads into the GPU hybrid model (TE Mamba
                  spec when TE and mamba_ssm import): logits equal transformers'.

Nothing is installed: megatron-core and torch come from the Python running this, megatron_cascade from
this working tree. Without a CUDA device it exits at once with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling check files, however this is loaded
sys.modules.setdefault("gpu_check", sys.modules[__name__])  # they import this module by that name
import gpu_check_fp8  # noqa: E402
import gpu_check_moe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXIT_NO_GPU = 2
# Adam moves each weight ~LR per step: a few steps change the ~0.02-sized weights by a few percent,
# well inside bf16 resolution of the fp32 masters' updates and far from a restart.
LR = 5e-5
# bf16 decode (paged flash-attn) vs bf16 teacher-forced recompute (TE fused attention): rounding only.
LOGPROB_TOLERANCE = 0.1


@dataclass
class Result:
    """Outcome of one check: status PASS / FAIL / SKIP, a one-line reason and its figures."""

    name: str
    status: str
    detail: str = ""
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        figs = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.figures.items())
        return f"{self.status:<4} {self.name:<15} {self.detail} {figs}".rstrip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results here (JSON)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per precision")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024, help="training sequence length (tokens)")
    parser.add_argument("--batch", type=int, default=8, help="training sequences per step")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sample")
    parser.add_argument("--write-cpu-checkpoint", metavar="DIR", help=argparse.SUPPRESS)  # the CPU subprocess
    gpu_check_moe.add_arguments(parser)
    return parser


def model_config(args: argparse.Namespace, precision: str):
    from megatron_cascade.config.model import ModelConfig

    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       num_query_groups=max(1, args.heads // 4), vocab_size=args.vocab,
                       ffn_hidden_size=args.hidden * 3, max_position_embeddings=max(4096, args.seq + 1),
                       precision=precision)


def probe_tokens(args: argparse.Namespace):
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, args.vocab, (2, 64), generator=gen)


# -- the CPU side: write a checkpoint and reference logits ----------------------------------------------
def write_cpu_checkpoint(args: argparse.Namespace, out_dir: str) -> None:
    """Runs in a subprocess with no CUDA device: local spec, fp32, as the CPU harness and converter do."""
    import torch

    from megatron_cascade.cascade.runtime import init_distributed, shutdown_distributed
    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, save_model_weights

    init_distributed()
    try:
        initialize_model_parallel(ParallelConfig(), seed=1)
        cfg = model_config(args, "fp32")
        model = build_gpt_model(cfg, ParallelConfig()).eval()
        save_model_weights(model, os.path.join(out_dir, "weights"), cfg)
        tokens = probe_tokens(args)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            logits = model(tokens, positions, None)
        torch.save({"tokens": tokens, "logits": logits.float()}, os.path.join(out_dir, "reference.pt"))
        gpu_check_moe.write_cpu_moe_checkpoint(args, out_dir)
    finally:
        shutdown_distributed()


def check_cpu_writer(args: argparse.Namespace, out_dir: str) -> Result:
    """The CPU side of the checkpoint checks, as its own result (its failure SKIPs only those)."""
    start = time.perf_counter()
    run_cpu_writer(args, out_dir)
    return Result("cpu_writer", "PASS", "dense and MoE checkpoints written on CPU (local spec, fp32)",
                  {"seconds": time.perf_counter() - start})


def run_cpu_writer(args: argparse.Namespace, out_dir: str) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--write-cpu-checkpoint", out_dir,
           "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
           "--vocab", str(args.vocab), "--seq", str(args.seq)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"CPU checkpoint writer failed ({res.returncode}):\n{res.stderr[-3000:]}")


# -- the GPU side -----------------------------------------------------------------------------------------
def _device():
    """The device the checks run on: the GPU (CPU only when a test drives ``run_checks`` on CPU)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def te_version() -> str | None:
    try:
        import transformer_engine
    except ImportError:
        return None
    return getattr(transformer_engine, "__version__", "unknown")


def check_cpu_checkpoint(policy, ref_dir: str) -> Result:
    import torch

    from megatron_cascade.training.policy import load_policy_weights

    load_policy_weights(policy, os.path.join(ref_dir, "weights"))
    ref = torch.load(os.path.join(ref_dir, "reference.pt"))
    tokens = ref["tokens"].to(_device())
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    model = policy.module.eval()
    with torch.no_grad():
        logits = model(tokens, positions, None).float().cpu()
    model.train()
    err = (logits - ref["logits"]).abs().max().item() / ref["logits"].abs().max().item()
    ok = err < 5e-2  # bf16 weights and compute vs fp32 on CPU
    from megatron_cascade.model.parallel import transformer_engine_available

    spec = "Transformer Engine" if transformer_engine_available() else "local"
    return Result("cpu_checkpoint", "PASS" if ok else "FAIL",
                  f"CPU-written local-spec weights load into the {spec}-spec model", {"max_rel_logit_err": err})


def train_batch(args: argparse.Namespace):
    import torch

    from megatron_cascade.training import TrainBatch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    mask = torch.zeros(args.batch, args.seq)
    mask[:, args.seq // 4:] = 1  # a prompt quarter outside the loss, as in RL batches
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask)


def flat_weights(policy):
    import torch

    return torch.cat([p.detach().float().flatten().cpu() for p in policy.module.parameters()])


def timed_steps(policy, args: argparse.Namespace) -> dict:
    """Warm-up step, then ``args.steps`` timed steps; figures of the timed ones."""
    from megatron_cascade.config.training import LossConfig, TrainingConfig
    from megatron_cascade.training import LossSpec, train_step

    batch = train_batch(args)
    # Cross-entropy on the masked tokens: a real gradient whatever the weights (an RL loss with
    # made-up sampler log-probs would be masked out by the importance correction).
    spec = LossSpec("sft", LossConfig(), vocab_size=args.vocab)
    training = TrainingConfig(micro_batch_size=max(1, args.batch // 2))
    metrics = train_step(policy, batch, spec, training)
    _sync()
    _reset_peak()
    start = time.perf_counter()
    for _ in range(args.steps):
        metrics = train_step(policy, batch, spec, training)
    _sync()
    step_s = (time.perf_counter() - start) / max(1, args.steps)
    return {"step_s": step_s, "tokens_per_s": args.batch * args.seq / step_s, "peak_mem_gib": _peak_gib(),
            "loss": float(metrics.get("loss", float("nan")))}


def check_bf16_step(policy, loaded, init, args: argparse.Namespace) -> Result:
    """Timed bf16 steps; with ``loaded`` (the weights cpu_checkpoint put in), that they train from those
    weights (the fp32 masters were reloaded) rather than snap back to ``init``."""
    import math

    figures = timed_steps(policy, args)
    if loaded is None:
        ok = math.isfinite(figures["loss"])
        return Result("bf16_step", "PASS" if ok else "FAIL", "no loaded checkpoint: the masters reload is not checked",
                      figures)
    after = flat_weights(policy)
    # Small lr and few steps: the weights move a little from the loaded ones. Had the masters kept
    # the build-time init, the first step would copy it back: distance to the loaded weights ~ O(1).
    moved = ((after - loaded).norm() / loaded.norm()).item()
    to_init = ((after - init).norm() / init.norm()).item()
    figures.update(rel_change_from_loaded=moved, rel_distance_to_init=to_init)
    ok = 0 < moved < 0.1 and moved < 0.5 * to_init and math.isfinite(figures["loss"])
    return Result("bf16_step", "PASS" if ok else "FAIL", "masters reloaded: trains from the loaded weights", figures)


def check_optimizer_resume(policy, args: argparse.Namespace) -> Result:
    """Save a training checkpoint, step (A); load it and redo the step twice (B, C). A == B bit for bit
    when B == C; when the step itself is not bit-reproducible (B != C), |A - B| within 2 |B - C|."""
    from megatron_cascade.config.training import LossConfig, TrainingConfig
    from megatron_cascade.training import LossSpec, train_step
    from megatron_cascade.training.resume_checkpoint import load_training_checkpoint, save_training_checkpoint

    batch, spec = train_batch(args), LossSpec("sft", LossConfig(), vocab_size=args.vocab)
    training = TrainingConfig(micro_batch_size=max(1, args.batch // 2))
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        path = save_training_checkpoint(root, 1, policy, {}, keep_last=1)
        save_s = time.perf_counter() - start
        after = []
        for redo in range(3):
            if redo:
                start = time.perf_counter()
                load_training_checkpoint(path, policy)
                load_s = time.perf_counter() - start
            train_step(policy, batch, spec, training)
            after.append(flat_weights(policy))
    resumed, spread = (after[0] - after[1]).abs().max().item(), (after[1] - after[2]).abs().max().item()
    figures = {"max_diff_resumed": resumed, "max_diff_redo": spread, "save_s": save_s, "load_s": load_s}
    if spread == 0.0:
        ok, detail = resumed == 0.0, "save -> load -> step equals the step without the round trip, bit for bit"
    else:
        ok, detail = resumed <= 2 * spread, "the step is not bit-reproducible here; the resumed one within its spread"
    if not ok:
        detail = "the resumed step differs from the step without the round trip (beyond the redos' spread)"
    return Result("optimizer_resume", "PASS" if ok else "FAIL", detail, figures)


def check_training_state_offload(policy, args: argparse.Namespace) -> Result:
    """``rollout.offload_training_state`` after a step: the device memory parking the grads and the
    optimizer state frees against their bytes, and the next step after bringing them back against the
    same step without parking (from one saved checkpoint: bit for bit when the step reproduces, else
    within twice the redo's spread)."""
    import torch

    from megatron_cascade.config.training import LossConfig, TrainingConfig
    from megatron_cascade.training import LossSpec, train_step
    from megatron_cascade.training.resume_checkpoint import load_training_checkpoint, save_training_checkpoint
    from megatron_cascade.training.state_offload import TrainingStateOffload

    batch, spec = train_batch(args), LossSpec("sft", LossConfig(), vocab_size=args.vocab)
    training = TrainingConfig(micro_batch_size=max(1, args.batch // 2))
    cuda = torch.cuda.is_available()
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for chunk in policy.chunks
                for b in list(chunk.buffers) + list(chunk.expert_parallel_buffers))
    offload = TrainingStateOffload(policy)
    with tempfile.TemporaryDirectory() as root:
        path = save_training_checkpoint(root, 1, policy, {}, keep_last=1)
        after = []
        for parked in (False, True, False):
            load_training_checkpoint(path, policy)
            if parked:
                _sync()
                before = torch.cuda.memory_allocated() if cuda else float("nan")
                start = time.perf_counter()
                offload.offload()
                offload_s = time.perf_counter() - start
                during = torch.cuda.memory_allocated() if cuda else float("nan")
                expected = grads + offload.parked_bytes
                start = time.perf_counter()
                offload.restore()
                restore_s = time.perf_counter() - start
            train_step(policy, batch, spec, training)
            after.append(flat_weights(policy))
    diff, spread = (after[1] - after[0]).abs().max().item(), (after[2] - after[0]).abs().max().item()
    freed = (before - during) / 2**30
    figures = {"freed_gib": freed, "grads_and_optimizer_gib": expected / 2**30, "offload_s": offload_s,
               "restore_s": restore_s, "max_diff_parked": diff, "max_diff_redo": spread}
    same = diff == 0.0 if spread == 0.0 else diff <= 2 * spread
    freed_ok = not cuda or freed >= 0.9 * expected / 2**30
    detail = (f"parked {expected / 2**30:.2f} GiB (freed {freed:.2f} GiB on the device), back in {restore_s:.3f} s; "
              f"the next step {'equals' if same else 'differs from'} the step without parking")
    return Result("training_state_offload", "PASS" if same and freed_ok else "FAIL", detail, figures)


def check_fused_logprob_head(policy, args: argparse.Namespace) -> Result:
    """One forward+backward with the fused log-prob head vs the logits path (same weights): the same
    loss at a lower peak (no [tokens, vocab] logits or logits gradient)."""
    import math

    from megatron_cascade.config.training import LossConfig, TrainingConfig
    from megatron_cascade.training import LossSpec
    from megatron_cascade.training.step import compute_gradients

    batch, figures = train_batch(args), {}
    training = TrainingConfig(micro_batch_size=max(1, args.batch // 2))
    for head in ("logits", "fused"):
        spec = LossSpec("sft", LossConfig(), vocab_size=args.vocab, output_head=head)
        compute_gradients(policy, batch, spec, training)  # warm-up
        _sync()
        _reset_peak()
        start = time.perf_counter()
        metrics = compute_gradients(policy, batch, spec, training)
        _sync()
        figures.update({f"{head}_s": time.perf_counter() - start, f"{head}_peak_gib": _peak_gib(),
                        f"{head}_loss": float(metrics["loss"])})
    same_loss = abs(figures["fused_loss"] - figures["logits_loss"]) <= 1e-3 * max(1.0, abs(figures["logits_loss"]))
    # Peak memory is measured on the GPU only (NaN when a test drives the check on CPU).
    lower_peak = math.isnan(figures["logits_peak_gib"]) or figures["fused_peak_gib"] < figures["logits_peak_gib"]
    ok = same_loss and lower_peak
    return Result("fused_logprob_head", "PASS" if ok else "FAIL", "fused head: the logits path's loss at a lower peak",
                  figures)


def varied_batch(args: argparse.Namespace):
    """A batch whose sequences run from a quarter of ``args.seq`` to all of it (loss on their second half)."""
    import torch

    from megatron_cascade.training import TrainBatch

    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.seq // 4, args.seq + 1, (args.batch,), generator=gen)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    mask = torch.zeros(args.batch, args.seq)
    for row, n in enumerate(lengths.tolist()):
        mask[row, n // 2:n] = 1
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask)


def check_packed_step(policy, args: argparse.Namespace) -> Result:
    """THD rows through TE (cu_seqlens, per-sequence RoPE) vs the padded batch: the same loss and
    gradient at bf16 tolerance; tokens run, time and peak memory of each."""
    import torch

    from megatron_cascade.config.training import LossConfig, TrainingConfig
    from megatron_cascade.training import LossSpec
    from megatron_cascade.training.step import _training_micro_batches, compute_gradients

    batch, spec, runs = varied_batch(args), LossSpec("sft", LossConfig(), vocab_size=args.vocab), {}
    for name, packed in (("padded", False), ("packed", True)):
        training = TrainingConfig(micro_batch_size=max(1, args.batch // 2), sequence_packing=packed)
        tokens = sum(m.input_ids.numel() for m in _training_micro_batches(policy, batch, training))
        _sync()
        _reset_peak()
        start = time.perf_counter()
        metrics = compute_gradients(policy, batch, spec, training)
        _sync()
        grad = torch.cat([p.main_grad.float().flatten() for p in policy.chunks[0].parameters()])
        runs[name] = (metrics["loss"], grad, tokens, time.perf_counter() - start, _peak_gib())
    (l0, g0, t0, s0, m0), (l1, g1, t1, s1, m1) = runs["padded"], runs["packed"]
    rel = ((g1 - g0).norm() / g0.norm()).item()
    ok = abs(l1 - l0) <= 1e-2 * abs(l0) and rel < 3e-2 and t1 < t0
    return Result("packed_step", "PASS" if ok else "FAIL", "THD rows give the padded loss and gradient",
                  dict(loss_padded=l0, loss_packed=l1, grad_rel_diff=rel, tokens_padded=t0, tokens_packed=t1,
                       padded_s=s0, packed_s=s1, padded_peak_gib=m0, packed_peak_gib=m1))


def replace_batch_for_fp8(args: argparse.Namespace) -> argparse.Namespace:
    """TE's FP8 GEMMs need token counts divisible by 16: round the sequence length up."""
    out = argparse.Namespace(**vars(args))
    out.seq = -(-args.seq // 16) * 16
    return out


def check_generation(policy, args: argparse.Namespace) -> Result:
    """The paged generator (flash-attn paged KV kernels on GPU; their torch stand-ins on CPU): every
    sample runs to its budget, and the log-probs it recorded while decoding equal a teacher-forced
    recompute of the same tokens through the training forward (no KV cache) to bf16 precision."""
    from megatron_cascade.stages.step_batches import rollout_batch
    from megatron_cascade.config.training import LossConfig
    from megatron_cascade.rollout import SamplingParams, generate
    from megatron_cascade.tokenizers import build_tokenizer
    from megatron_cascade.training import LossSpec, forward_logprobs

    tokenizer = build_tokenizer("builtin:char")
    prompts = [tokenizer.encode(f"question {i}: what is {i} + {i}?") for i in range(8)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=4, seed=0, ignore_eos=True)
    _sync()
    _reset_peak()
    start = time.perf_counter()
    out = generate(policy.module, prompts, params, tokenizer=tokenizer)
    _sync()
    seconds = time.perf_counter() - start
    new = sum(len(s.response_ids) for s in out.samples)
    import torch

    batch = rollout_batch(out, tokenizer, keep=torch.ones(len(out.samples), dtype=torch.bool), advantages=None)
    spec = LossSpec("mopd", LossConfig(), temperature=1.0, vocab_size=tokenizer.vocab_size)
    recomputed = forward_logprobs(policy.chunks, batch, spec, micro_batch_size=8).float().cpu()
    mask = batch.loss_mask.bool()
    gap = float((recomputed[mask] - batch.inference_logprobs[mask].float()).abs().max())
    ok = new == len(prompts) * params.n * args.new_tokens and gap < LOGPROB_TOLERANCE
    return Result("generation", "PASS" if ok else "FAIL",
                  f"{len(out.samples)} samples, paged KV cache; decode vs recompute log-prob gap {gap:.3g} "
                  f"(tolerance {LOGPROB_TOLERANCE})",
                  {"new_tokens": new, "seconds": seconds, "new_tokens_per_s": new / seconds,
                   "max_logprob_gap": gap, "peak_mem_gib": _peak_gib(), "kv_cache_gib": out.stats.kv_cache_bytes / 2**30})


def check_decode_copy(policy, args: argparse.Namespace) -> Result:
    """The decode copy (rollout.parallel) on this one GPU: refit over NCCL with megatron-core's
    resharding (bf16, Float16Module), every parameter bit-identical to the policy's, greedy tokens
    equal the policy's; and KV on demand under a budget of two blocks per sample preempts and still
    gives the same tokens."""
    import torch

    from megatron_cascade.config.model import DecodeParallelConfig
    from megatron_cascade.rollout import KVCacheConfig, SamplingParams, generate
    from megatron_cascade.rollout.kv_budget import kv_layout
    from megatron_cascade.tokenizers import build_tokenizer
    from megatron_cascade.training.decode_copy import DecodeCopy
    from megatron_cascade.training.policy import unwrap

    copy = DecodeCopy(policy.model_config, DecodeParallelConfig())
    _sync()
    start = time.perf_counter()
    copy.refit(policy)
    _sync()
    first = time.perf_counter() - start
    start = time.perf_counter()
    copy.refit(policy)
    _sync()
    cached = time.perf_counter() - start
    mine = unwrap(copy.module).state_dict()
    differ = [k for k, v in unwrap(policy.module).state_dict().items()
              if not k.endswith("_extra_state") and not torch.equal(v, mine[k])]
    tokenizer = build_tokenizer("builtin:char")
    prompts = [tokenizer.encode(f"question {i}: what is {i} + {i}?") for i in range(8)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, n=2, ignore_eos=True)
    trained = [s.response_ids for s in generate(policy.module, prompts, params, tokenizer=tokenizer)]
    decoded = [s.response_ids for s in generate(copy.module, prompts, params, tokenizer=tokenizer)]
    blocks = -(-(max(len(p) for p in prompts) + args.new_tokens) // 256)  # the longest sample's
    layout = kv_layout(unwrap(copy.module), 256, tp=1)
    tight = KVCacheConfig(kv_cache_bytes=(2 * blocks + 1) * layout.block_bytes, block_size_tokens=256)
    preempting = generate(copy.module, prompts, params, tokenizer=tokenizer, kv_cache=tight)
    ok = not differ and trained == decoded and [s.response_ids for s in preempting] == decoded
    gb = copy.refit_bytes / 1e9
    return Result("decode_copy", "PASS" if ok else "FAIL",
                  f"refit {copy.refit_bytes / 2**20:.1f} MiB over NCCL: first {first:.3f} s, cached {cached:.4f} s "
                  f"({gb / max(cached, 1e-9):.1f} GB/s); {len(differ)} tensors differ; tokens equal the policy's: "
                  f"{trained == decoded}; under a 2-sample KV budget ({preempting.stats.preemptions} preemptions): "
                  f"{[s.response_ids for s in preempting] == decoded}",
                  {"refit_first_s": first, "refit_cached_s": cached, "differ": differ[:5],
                   "preemptions": preempting.stats.preemptions})


def check_decode_cuda_graphs(policy, args: argparse.Namespace) -> Result:
    """rollout.cuda_graphs on the decode copy: megatron-core's local graph managers on its layers
    (decode steps only), 64 greedy requests of long-tailed lengths (stop tokens; ragged decode steps
    padded to 8 graph sizes): the same tokens as the eager copy, and both calls' decode tokens/s —
    each graph call captures its sizes again (they point into the call's KV buffer), which the
    timing includes, as in a real run."""
    from megatron_cascade.config.model import DecodeParallelConfig
    from megatron_cascade.rollout import KVCacheConfig, SamplingParams, generate
    from megatron_cascade.tokenizers import build_tokenizer
    from megatron_cascade.training.decode_copy import DecodeCopy

    tokenizer = build_tokenizer("builtin:char")
    prompts = [tokenizer.encode(f"question {i}: what is {i} x {i + 3}?") for i in range(32)]
    stops = tuple(tokenizer.encode("7")[-1:]) + tuple(tokenizer.encode("e")[-1:])
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, n=2, stop_token_ids=stops, ignore_eos=True)
    results = {}
    for name, graphs in (("eager", False), ("graphs", True)):
        copy = DecodeCopy(policy.model_config, DecodeParallelConfig(), cuda_graphs=graphs)
        copy.refit(policy)
        kv_cache = KVCacheConfig(cuda_graphs=8 if graphs else None)
        generate(copy.module, prompts[:2], params, tokenizer=tokenizer, kv_cache=kv_cache)  # warm-up
        _sync()
        start = time.perf_counter()
        out = generate(copy.module, prompts, params, tokenizer=tokenizer, kv_cache=kv_cache)
        _sync()
        seconds = time.perf_counter() - start
        new = sum(len(s.response_ids) for s in out.samples)
        results[name] = ([s.response_ids for s in out.samples], new / seconds, copy.graphed_layers)
        copy.release()
        del copy
    (eager, eager_rate, _), (graphed, graph_rate, layers) = results["eager"], results["graphs"]
    lengths = sorted(len(t) for t in eager)
    ok = eager == graphed and (layers > 0 or not _cuda())
    return Result("decode_cuda_graphs", "PASS" if ok else "FAIL",
                  f"{len(eager)} requests, lengths {lengths[0]}-{lengths[-1]}; {layers} graphed layers; tokens equal "
                  f"eager: {eager == graphed}; decode {graph_rate:.0f} vs {eager_rate:.0f} tokens/s "
                  f"({graph_rate / eager_rate:.2f}x, capture included)",
                  {"graph_tokens_per_s": graph_rate, "eager_tokens_per_s": eager_rate, "graphed_layers": layers,
                   "speedup": graph_rate / eager_rate})


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


NEMOTRON_H_TINY = dict(vocab_size=512, hidden_size=256, hybrid_override_pattern="M*ME-", num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, intermediate_size=512, mamba_num_heads=8, mamba_head_dim=64,
                       ssm_state_size=64, n_groups=2, conv_kernel=4, chunk_size=64, n_routed_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=256, moe_shared_expert_intermediate_size=512,
                       routed_scaling_factor=2.5, max_position_embeddings=512, layer_norm_epsilon=1e-5)


def check_nemotron_h_conversion(work_dir: str) -> Result:
    """A tiny random nemotron_h converted by the CLI (a CPU process: local spec, TE names on disk) loads
    into the GPU hybrid model (TE ``mamba_stack_spec`` when TE imports; needs mamba_ssm there): its
    logits equal transformers' (fp32 on both sides; TF32 GEMMs allowed for)."""
    import torch
    import transformers

    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.convert.compare import megatron_logits, sample_tokens

    hf_dir, meg_dir = os.path.join(work_dir, "nemotron_h_hf"), os.path.join(work_dir, "nemotron_h_meg")
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**NEMOTRON_H_TINY)).eval()
    hf.save_pretrained(hf_dir)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run([sys.executable, "-m", "megatron_cascade.convert", "hf-to-megatron", "--hf", hf_dir,
                          "--out", meg_dir], capture_output=True, text=True, timeout=300, env=env)
    if res.returncode != 0:
        return Result("nemotron_h_te", "FAIL", f"hf-to-megatron: {res.stderr[-500:]}")
    tokens = sample_tokens(NEMOTRON_H_TINY["vocab_size"], 64)
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    ours = megatron_logits(meg_dir, tokens, ParallelConfig())  # run_checks' TP=1 parallel state
    diff = (ours - ref).abs().max().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ok = diff <= 2e-2 and agree == 1.0
    return Result("nemotron_h_te", "PASS" if ok else "FAIL", "CPU-converted nemotron_h in the GPU hybrid model",
                  {"max_abs_logit_diff": diff, "top1_agreement": agree, "te": te_version() or "none"})


class ResultLog:
    """Each result printed and (with a path) the JSON list rewritten the moment its check ends, so a
    hang or the outer timeout loses only the check that was running."""

    def __init__(self, json_path: Optional[str] = None) -> None:
        self.path = Path(json_path) if json_path else None
        self.results: list[Result] = []

    def add(self, result: Result) -> Result:
        self.results.append(result)
        print(result.line(), flush=True)
        if self.path is not None:
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text(json.dumps([vars(r) for r in self.results], indent=2))
            os.replace(partial, self.path)
        return result


def run_checks(args: argparse.Namespace, on_result: Optional[Callable[[Result], object]] = None) -> list[Result]:
    """Every check in turn (``on_result`` called with each result as it ends); returns them all."""
    import torch

    from megatron_cascade.cascade.runtime import init_distributed, shutdown_distributed
    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.config.training import OptimizerConfig
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.model.parallel import transformer_engine_available
    from megatron_cascade.training import build_policy

    results: list[Result] = []

    def guard(name: str, check) -> Result:
        result = guarded(name, check)
        if on_result is not None:
            on_result(result)
        return result

    with tempfile.TemporaryDirectory() as ref_dir:
        init_distributed()
        try:
            # The graph-safe RNG tracker: megatron-core's graph managers (decode_cuda_graphs) refuse others.
            initialize_model_parallel(ParallelConfig(), seed=0, cuda_graphs=True)
            # What the model builder uses (a TE whose PyTorch extension does not load counts as absent).
            te = transformer_engine_available()
            results.append(guard("moe_slice", lambda: gpu_check_moe.check_moe_slice(args, te)))
            results.append(guard("hybrid_slice", lambda: gpu_check_moe.check_hybrid_slice(args, te)))
            results.append(guard("cpu_writer", lambda: check_cpu_writer(args, ref_dir)))
            written = results[-1].status == "PASS"

            def from_reference(name: str, check) -> Result:
                """A check of the CPU-written checkpoints: SKIP without them."""
                if written:
                    return guard(name, check)
                return guard(name, lambda: Result(name, "SKIP", "no CPU-written checkpoint (cpu_writer failed)"))

            results.append(from_reference("moe_checkpoint",
                                          lambda: gpu_check_moe.check_moe_checkpoint(args, ref_dir, te)))
            policy = build_policy(model_config(args, "bf16"), ParallelConfig(), OptimizerConfig(lr=LR),
                                  total_steps=args.steps + 2)
            init = flat_weights(policy)
            results.append(from_reference("cpu_checkpoint", lambda: check_cpu_checkpoint(policy, ref_dir)))
            loaded = flat_weights(policy) if results[-1].status == "PASS" else None
            results.append(guard("bf16_step", lambda: check_bf16_step(policy, loaded, init, args)))
            results.append(guard("optimizer_resume", lambda: check_optimizer_resume(policy, args)))
            results.append(guard("training_state_offload", lambda: check_training_state_offload(policy, args)))
            results.append(guard("fused_logprob_head", lambda: check_fused_logprob_head(policy, args)))
            results.append(guard("packed_step", lambda: check_packed_step(policy, args)))
            results.append(guard("generation", lambda: check_generation(policy, args)))
            results.append(guard("decode_copy", lambda: check_decode_copy(policy, args)))
            results.append(guard("decode_cuda_graphs", lambda: check_decode_cuda_graphs(policy, args)))
            del policy
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            results.extend(gpu_check_fp8.run_fp8_checks(args, guard))
            results.append(guard("nemotron_h_te", lambda: check_nemotron_h_conversion(ref_dir)))
        finally:
            shutdown_distributed()
    return results


def guarded(name: str, check) -> Result:
    """Run one check; an exception is that check's FAIL (the others still run)."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return Result(name, "FAIL", f"{type(exc).__name__}: {str(exc)[:500]}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.write_cpu_checkpoint:
        write_cpu_checkpoint(args, args.write_cpu_checkpoint)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False): nothing checked; "
              "run it on a GPU machine", file=sys.stderr)
        return EXIT_NO_GPU
    import megatron.core

    te = te_version()
    te_text = te or "ABSENT: local spec, TE parts skipped"
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"megatron-core {megatron.core.__version__}, transformer-engine {te_text}")
    print(f"model: {args.layers} layers x {args.hidden} hidden, vocab {args.vocab}; step = {args.batch} x {args.seq} "
          "tokens")
    from megatron_cascade.torch_kernels import enable_torch_kernels

    # A node with torch only (the carried wheelhouse: scripts/gpu_wheelhouse.sh): exact torch kernels.
    print(f"torch stand-ins for: {', '.join(enable_torch_kernels()) or 'nothing (every kernel package imports)'}")
    start = time.perf_counter()
    results = run_checks(args, on_result=ResultLog(args.json).add)
    print(f"gpu_check: {time.perf_counter() - start:.0f} s")
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
