"""gpu_check's checks at the recipes' widths (called by ``gpu_check.run_checks``; one concern per file).

moe_slice      the Qwen3-30B-A3B recipe's model (``examples/nemotron_cascade2/06_code_rl.yaml``: widths,
               128 experts top-8, qk_layernorm, full recompute, distributed optimizer with overlapped
               grad reduce and param gather; grouped GEMM when TE imports) cut to 4 layers on one GPU,
               a training step timed at each of ``--slice-seqs`` tokens, its peak memory set against
               the dry run's formula for the same shape (``cascade/plan/``). A sequence the formula
               says does not fit this GPU is SKIPped with the planned figure (so is the local spec's
               unfused [heads, s, s] attention at 32K). FAIL: a measured peak above the plan by more
               than ``PLAN_MARGIN`` (the recipe is planned up to 76.1 of 80 GiB per GPU: the plan must
               not be low), or a non-finite loss.
hybrid_slice   the same for the Nemotron-3-Nano recipe's hybrid model (``nemotron_3_nano/cascade.yaml``)
               cut to the pattern ``HYBRID_SLICE_PATTERN`` (Mamba-2, MoE with a shared expert,
               attention); the peak is held to the plan only with the mamba_ssm kernels (the torch
               stand-ins keep other intermediates).
moe_checkpoint a tiny MoE written on CPU (local spec: one weight per expert, SequentialMLP) loads into the
               GPU model with grouped experts (TE ``TEGroupedMLP`` when TE imports): logits agree at
               bf16 tolerance.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_check import Result

REPO = Path(__file__).resolve().parents[1]
MOE_RECIPE = REPO / "examples" / "nemotron_cascade2" / "06_code_rl.yaml"
HYBRID_RECIPE = REPO / "examples" / "nemotron_cascade2" / "nemotron_3_nano" / "cascade.yaml"
# Two Mamba-2 layers, two MoE layers, one attention layer: each kind of the Nano pattern.
HYBRID_SLICE_PATTERN = "MEM*E"
GIB = 2**30
# The share of the GPU a planned sequence may take (CUDA context, allocator slack): above it, SKIP.
DEVICE_SHARE = 0.85
# Measured peak over planned peak above which the plan is called low: allocator rounding and the
# few transient buffers the formula leaves out (router scores, permutation indices) stay within it.
PLAN_MARGIN = 0.10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--moe-recipe", default=str(MOE_RECIPE), help="the recipe whose model moe_slice takes")
    parser.add_argument("--hybrid-recipe", default=str(HYBRID_RECIPE),
                        help="the recipe whose model hybrid_slice takes")
    parser.add_argument("--slice-seqs", type=int, nargs="+", default=[8192, 32768],
                        help="tokens per training sequence of the slices, one timed step each")
    parser.add_argument("--moe-set", action="append", default=[], metavar="KEY=VALUE",
                        help="further overrides of the MoE recipe (tests shrink the widths with these)")
    parser.add_argument("--hybrid-set", action="append", default=[], metavar="KEY=VALUE",
                        help="further overrides of the hybrid recipe")


def slice_config(recipe: str, overrides: list[str], transformer_engine: bool):
    """``recipe``'s RunConfig with ``overrides`` on ONE GPU (TP=PP=EP=CP=1; the distributed optimizer
    and its overlaps kept), grouped GEMM and the plan's fused attention iff TE imports."""
    from megatron_cascade.config.loader import load_config

    te = str(transformer_engine).lower()
    one_gpu = [f"model.moe.grouped_gemm={te}", f"cluster.transformer_engine={te}", "cluster.nodes=1",
               "cluster.gpus_per_node=1", "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
               "parallel.pipeline_model_parallel_size=1", "parallel.expert_model_parallel_size=1",
               "parallel.expert_tensor_parallel_size=1", "parallel.context_parallel_size=1"]
    return load_config(recipe, [*one_gpu, *overrides], check_paths=False)


def moe_slice_config(args: argparse.Namespace, transformer_engine: bool):
    """The Qwen3-30B-A3B recipe's model at 4 layers on one GPU."""
    return slice_config(args.moe_recipe, ["model.num_layers=4", *args.moe_set], transformer_engine)


def hybrid_slice_config(args: argparse.Namespace, transformer_engine: bool):
    """The Nemotron-3-Nano recipe's model at ``HYBRID_SLICE_PATTERN`` on one GPU."""
    pattern = [f"model.num_layers={len(HYBRID_SLICE_PATTERN)}", f"model.hybrid.layer_pattern={HYBRID_SLICE_PATTERN}"]
    return slice_config(args.hybrid_recipe, [*pattern, *args.hybrid_set], transformer_engine)


def planned_gib(cfg, seq: int) -> dict:
    """The dry run's per-GPU memory for one training micro-batch of one ``seq``-token sequence:
    weights + fp32 grads + optimizer state, the activations the recompute policy keeps, the
    fused log-prob head (GiB each, and their sum)."""
    from megatron_cascade.cascade.plan import (Shape, fused_head_bytes, memory_per_gpu, routed_load,
                                               training_activation_bytes)
    from megatron_cascade.model.parallel import resolve_layout

    layout = resolve_layout(cfg.model, cfg.parallel, 1, check_this_machine=False)
    static = memory_per_gpu(cfg, 1)["total_gib"]
    activations = training_activation_bytes(cfg, layout, Shape(seq, 1, routed_load(cfg, layout)), in_flight=1) / GIB
    head = fused_head_bytes(cfg.model, layout, seq) / GIB
    return {"static": static, "activations": activations, "head": head, "total": static + activations + head}


def _device_gib() -> float:
    import torch

    return torch.cuda.mem_get_info()[1] / GIB if torch.cuda.is_available() else math.inf


def _one_sequence(vocab: int, seq: int):
    import torch

    from megatron_cascade.training import TrainBatch

    ids = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(seq))
    mask = torch.zeros(1, seq)
    mask[:, seq // 8:] = 1  # an RL row: the prompt outside the loss
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask)


def check_moe_slice(args: argparse.Namespace, transformer_engine: bool) -> "Result":
    cfg = moe_slice_config(args, transformer_engine)
    return check_slice("moe_slice", "Qwen3-30B-A3B", cfg, args.slice_seqs, hold_to_plan=True)


def check_hybrid_slice(args: argparse.Namespace, transformer_engine: bool) -> "Result":
    from megatron.core.ssm import mamba_mixer

    cfg = hybrid_slice_config(args, transformer_engine)
    # The stand-ins for missing mamba_ssm kernels (torch_kernels.py) hold other intermediates than
    # the fused kernels the plan counts: their peak is reported, not judged.
    real_kernels = mamba_mixer.HAVE_MAMBA_SSM and "mamba_reference" not in mamba_mixer.mamba_chunk_scan_combined.__module__
    return check_slice("hybrid_slice", "Nemotron-3-Nano", cfg, args.slice_seqs, hold_to_plan=real_kernels)


def check_slice(name: str, what: str, cfg, seqs: list[int], hold_to_plan: bool) -> "Result":
    """Build ``cfg``'s policy, time one training step per sequence length, set each peak against the plan."""
    import torch

    from gpu_check import LR, Result, _peak_gib, _reset_peak, _sync
    from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
    from megatron_cascade.training import LossSpec, build_policy, train_step

    m = cfg.model
    policy = build_policy(m, cfg.parallel, OptimizerConfig(lr=LR), total_steps=2 * len(seqs) + 2)
    spec = LossSpec("sft", LossConfig(), vocab_size=m.vocab_size)
    training = TrainingConfig(micro_batch_size=1)
    figures: dict = {"layers": m.num_layers, "experts": m.moe.num_experts, "grouped_gemm": m.moe.grouped_gemm}
    ok, low, ran = True, [], 0
    try:
        for seq in seqs:
            plan = planned_gib(cfg, seq)
            figures[f"planned_gib_{seq}"] = plan["total"]
            if plan["total"] > DEVICE_SHARE * _device_gib():
                figures[f"skipped_{seq}"] = "plan exceeds this GPU"
                continue
            batch = _one_sequence(m.vocab_size, seq)
            train_step(policy, batch, spec, training)  # warm-up (allocator, TE workspaces, kernels)
            _sync()
            _reset_peak()
            start = time.perf_counter()
            metrics = train_step(policy, batch, spec, training)
            _sync()
            step_s = time.perf_counter() - start
            peak = _peak_gib()
            ran += 1
            figures.update({f"step_s_{seq}": step_s, f"tokens_per_s_{seq}": seq / step_s, f"peak_gib_{seq}": peak,
                            f"peak_over_plan_{seq}": peak / plan["total"]})
            ok = ok and math.isfinite(float(metrics["loss"]))
            if hold_to_plan and peak > plan["total"] * (1 + PLAN_MARGIN):  # NaN (no CUDA) compares False
                low.append(seq)
    finally:
        del policy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not ran:
        return Result(name, "SKIP", "the plan puts every sequence above this GPU's memory", figures)
    if low:
        return Result(name, "FAIL", f"measured peak above the plan by more than {PLAN_MARGIN:.0%} at {low} tokens: "
                      "the dry run under-plans this model's training", figures)
    judged = "peak within the plan" if hold_to_plan else "peak not judged (torch stand-in kernels)"
    detail = f"{what}-width slice trains; {judged}" if ok else "non-finite loss"
    return Result(name, "PASS" if ok else "FAIL", detail, figures)


# -- a CPU-written MoE checkpoint into grouped experts ---------------------------------------------------
def tiny_moe_config(args: argparse.Namespace, precision: str, grouped_gemm: bool):
    """gpu_check's dense test model with every layer MoE (8 experts, top-2, qk_layernorm)."""
    from gpu_check import model_config

    from megatron_cascade.config.model import MoEConfig

    return replace(model_config(args, precision), qk_layernorm=True,
                   moe=MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=max(8, args.hidden // 2),
                                 grouped_gemm=grouped_gemm))


def write_cpu_moe_checkpoint(args: argparse.Namespace, out_dir: str) -> None:
    """On the CPU side (``gpu_check.write_cpu_checkpoint``'s process): local spec, fp32, SequentialMLP."""
    import torch

    from gpu_check import probe_tokens
    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.model import build_gpt_model, save_model_weights

    cfg = tiny_moe_config(args, "fp32", grouped_gemm=False)
    model = build_gpt_model(cfg, ParallelConfig()).eval()
    save_model_weights(model, os.path.join(out_dir, "moe_weights"), cfg)
    tokens = probe_tokens(args)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    torch.save({"tokens": tokens, "logits": logits.float()}, os.path.join(out_dir, "moe_reference.pt"))


def check_moe_checkpoint(args: argparse.Namespace, ref_dir: str, transformer_engine: bool) -> "Result":
    import torch

    from gpu_check import Result, _device
    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.model import build_gpt_model, load_model_weights
    from megatron_cascade.training.policy import in_model_precision

    cfg = tiny_moe_config(args, "bf16", grouped_gemm=transformer_engine)
    model = in_model_precision(build_gpt_model(cfg, ParallelConfig()), cfg).eval()
    load_model_weights(model, os.path.join(ref_dir, "moe_weights"), cfg)
    ref = torch.load(os.path.join(ref_dir, "moe_reference.pt"))
    tokens = ref["tokens"].to(_device())
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None).float().cpu()
    err = (logits - ref["logits"]).abs().max().item() / ref["logits"].abs().max().item()
    # bf16 on both the router's top-2 choice and the experts: a near-tie may route a token otherwise.
    agree = (logits.argmax(-1) == ref["logits"].argmax(-1)).float().mean().item()
    ok = err < 5e-2 and agree >= 0.95
    experts = next(type(mod).__name__ for name, mod in model.named_modules() if name.endswith("mlp.experts"))
    return Result("moe_checkpoint", "PASS" if ok else "FAIL", f"CPU-written SequentialMLP weights load into {experts}",
                  {"max_rel_logit_err": err, "top1_agreement": agree})
