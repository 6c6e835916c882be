"""gpu_check's FP8 checks (called by ``gpu_check.run_checks``): Transformer Engine only, each a SKIP
without it. One FP8 policy (hybrid format, delayed scaling) serves them all, in this order:

fp8_step        timed training steps: a finite loss (the scales' amax histories fill);
fp8_resume      a training checkpoint of it (the FP8 scales travel in ``_extra_state``: the checkpoint
                allow-list must admit Megatron's ``TEDelayedScaling``) loaded into a fresh FP8 policy:
                teacher-forced log-probs bit-equal to the saved policy's;
fp8_reference   the frozen model an FP8 policy's KL reference and teachers run on (``build_frozen_model``:
                bf16 GEMMs, no amax history to trust) loaded from that checkpoint: its log-probs vs the
                FP8 policy's (FP8's rounding: the floor under the KL term at the first step);
fp8_generation  the paged generator on the FP8 policy (every forward padded to FP8's multiples): decode
                log-probs vs a teacher-forced recompute, as ``generation`` checks bf16.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from gpu_check import Result

FP8_CHECKS = ("fp8_step", "fp8_resume", "fp8_reference", "fp8_generation")
# Mean |log-prob| gap per loss token between the FP8 policy and its bf16-GEMM frozen copy above which
# FP8 is more than rounding (e4m3 keeps 3 mantissa bits: ~6% per product, averaged over a GEMM).
REFERENCE_GAP = 0.1


def run_fp8_checks(args: argparse.Namespace, guard, fp8_format: Optional[str] = "hybrid") -> list["Result"]:
    """The four checks in order (``guard(name, fn)`` runs one and reports it); SKIPs without TE.
    ``fp8_format=None`` runs the same code without FP8 (how the CPU tests drive it, TE absent)."""
    from gpu_check import Result

    from megatron_cascade.model.parallel import transformer_engine_available

    if fp8_format is not None and not transformer_engine_available():
        return [guard(name, lambda name=name: Result(name, "SKIP", "Transformer Engine (PyTorch) does not import"))
                for name in FP8_CHECKS]
    from gpu_check import LR, model_config, replace_batch_for_fp8

    from megatron_cascade.config.model import FP8Config, ParallelConfig
    from megatron_cascade.config.training import OptimizerConfig
    from megatron_cascade.training import build_policy

    cfg = replace(model_config(args, "bf16"), fp8=FP8Config(format=fp8_format, recipe="delayed"))
    fp8_args = replace_batch_for_fp8(args)
    policy = build_policy(cfg, ParallelConfig(), OptimizerConfig(lr=LR), total_steps=args.steps + 4)
    results = [guard("fp8_step", lambda: check_fp8_step(policy, fp8_args))]
    with tempfile.TemporaryDirectory() as root:
        saved: dict = {}  # fp8_resume's checkpoint, which fp8_reference loads
        results.append(guard("fp8_resume", lambda: check_fp8_resume(policy, cfg, fp8_args, root, saved)))
        results.append(guard("fp8_reference", lambda: check_fp8_reference(policy, cfg, fp8_args, saved)))
    results.append(guard("fp8_generation", lambda: check_fp8_generation(policy, args)))
    return results


def check_fp8_step(policy, args: argparse.Namespace) -> "Result":
    from gpu_check import Result, timed_steps

    figures = timed_steps(policy, args)
    ok = math.isfinite(figures["loss"])
    return Result("fp8_step", "PASS" if ok else "FAIL", "FP8 hybrid, delayed scaling", figures)


def _logprobs(chunks, args: argparse.Namespace):
    from gpu_check import train_batch

    from megatron_cascade.config.training import LossConfig
    from megatron_cascade.training import LossSpec, forward_logprobs

    batch = train_batch(args)
    spec = LossSpec("sft", LossConfig(), vocab_size=args.vocab)
    return forward_logprobs(chunks, batch, spec, micro_batch_size=max(1, args.batch // 2)).float().cpu(), batch


def check_fp8_resume(policy, cfg, args: argparse.Namespace, root: str, saved: dict) -> "Result":
    from gpu_check import LR, Result

    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.config.training import OptimizerConfig
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import load_training_checkpoint, save_training_checkpoint

    path = saved["path"] = save_training_checkpoint(root, 1, policy, {}, keep_last=1)
    before, batch = _logprobs(policy.chunks, args)
    fresh = build_policy(cfg, ParallelConfig(), OptimizerConfig(lr=LR), total_steps=args.steps + 4)
    load_training_checkpoint(path, fresh)
    loaded, _ = _logprobs(fresh.chunks, args)
    mask = batch.loss_mask.bool()
    diff = float((before[mask] - loaded[mask]).abs().max())
    ok = diff == 0.0
    detail = ("the loaded FP8 policy's log-probs equal the saved one's, bit for bit" if ok
              else "the loaded FP8 policy computes other log-probs (weights or FP8 scales not restored)")
    return Result("fp8_resume", "PASS" if ok else "FAIL", detail, {"max_logprob_diff": diff})


def check_fp8_reference(policy, cfg, args: argparse.Namespace, saved: dict) -> "Result":
    from gpu_check import Result

    from megatron_cascade.config.model import ParallelConfig
    from megatron_cascade.model import load_model_weights
    from megatron_cascade.training.policy import build_frozen_model

    if "path" not in saved:
        return Result("fp8_reference", "SKIP", "no FP8 checkpoint to load (fp8_resume did not write one)")
    weights = os.path.join(saved["path"], "weights")
    frozen = build_frozen_model(cfg, ParallelConfig())
    load_model_weights(frozen, weights, cfg)
    fp8, batch = _logprobs(policy.chunks, args)
    bf16, _ = _logprobs([frozen], args)
    mask = batch.loss_mask.bool()
    gap = (fp8[mask] - bf16[mask]).abs()
    mean, worst = float(gap.mean()), float(gap.max())
    ok = math.isfinite(worst) and mean < REFERENCE_GAP
    return Result("fp8_reference", "PASS" if ok else "FAIL",
                  f"bf16-GEMM frozen copy vs the FP8 policy: mean |log-prob gap| {mean:.3g} per token "
                  f"(tolerance {REFERENCE_GAP})", {"mean_logprob_gap": mean, "max_logprob_gap": worst})


def check_fp8_generation(policy, args: argparse.Namespace) -> "Result":
    from gpu_check import check_generation

    result = check_generation(policy, args)
    return replace(result, name="fp8_generation", detail="FP8 policy: " + result.detail)
