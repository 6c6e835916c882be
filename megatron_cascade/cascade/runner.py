"""The cascade: stages in order, each from the previous one's final weights, resumable at any point."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from megatron_cascade.cascade.data import load_examples
from megatron_cascade.cascade.manifest import Manifest
from megatron_cascade.cascade.runtime import (
    EXIT_REQUEUE,
    Preempted,
    PreemptionWatch,
    init_distributed,
    is_main_rank,
    shutdown_distributed,
)
from megatron_cascade.cascade.scoring import build_domain_rewards
from megatron_cascade.cascade.stage import RunContext, StageRunner
from megatron_cascade.config import ConfigError, RunConfig, resolve_stage, to_yaml
from megatron_cascade.model import initialize_model_parallel, resolve_layout
from megatron_cascade.tokenizers import build_tokenizer

log = logging.getLogger(__name__)


def build_context(cfg: RunConfig) -> RunContext:
    """Tokenizer, manifest, eval sets and rewards for a run (distributed must be initialised)."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}; raise model.vocab_size")
    eval_domains = sorted(d for d, spec in cfg.domains.items() if spec.eval)
    eval_sets = {d: load_examples(cfg.domains[d].eval, d, tokenizer, on_bad_row=cfg.data.on_bad_row,
                                  max_prompt_tokens=cfg.data.max_prompt_tokens) for d in eval_domains}
    rewards = build_domain_rewards(cfg.domains, eval_domains)
    return RunContext(cfg, tokenizer, Manifest(cfg.output_dir),
                      PreemptionWatch(margin_s=cfg.checkpoint.time_limit_margin_s), eval_sets, rewards)


def _write_run_files(cfg: RunConfig) -> None:
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))


def run_cascade(cfg: RunConfig, only_stage: str | None = None) -> int:
    """Run every incomplete stage (or only ``only_stage``); returns the process exit code
    (0 done, ``EXIT_REQUEUE`` after checkpointing on a preemption signal)."""
    init_distributed(cfg.distributed.timeout_minutes)
    try:
        layout = resolve_layout(cfg.model, cfg.parallel, dist.get_world_size())
        initialize_model_parallel(cfg.parallel, cfg.seed, timeout_minutes=cfg.distributed.timeout_minutes)
        if is_main_rank():
            _write_run_files(cfg)
            log.info("layout: %s", layout)
        dist.barrier()
        ctx = build_context(cfg)
        names = [s.name for s in cfg.stages]
        if is_main_rank() and ctx.manifest.data.get("stage_order") != names:
            ctx.manifest.record("stage_order", names)
        if only_stage is not None and only_stage not in names:
            raise ConfigError(f"--stage {only_stage!r}: no such stage (stages: {names})")
        offset = 0
        for index, stage_cfg in enumerate(cfg.stages):
            stage = resolve_stage(cfg, stage_cfg)
            if ctx.manifest.is_complete(stage.name):
                log.info("stage %s is complete; skipping", stage.name)
            elif only_stage is None or only_stage == stage.name:
                ctx.preemption.start_stage()
                StageRunner(ctx, index, stage).run(offset)
                ctx.manifest = Manifest(cfg.output_dir)  # re-read: rank 0 wrote it
            offset += stage.steps
        return 0
    except Preempted as exc:
        log.warning("%s; exiting with %d so the job is requeued", exc, EXIT_REQUEUE)
        return EXIT_REQUEUE
    finally:
        shutdown_distributed()
