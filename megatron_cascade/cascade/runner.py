"""The cascade: stages in order, each from the previous one's final weights, resumable at any point."""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_cascade.stages.prompt_data import load_examples
from megatron_cascade.environments.settings import domain_row_check
from megatron_cascade.cascade.manifest import Manifest
from megatron_cascade.cascade.preflight import preflight
from megatron_cascade.cascade.resume_check import check_resume
from megatron_cascade.cascade.run_lock import RunLock, RunLockError, acquire_run_lock
from megatron_cascade.cascade.runtime import (
    EXIT_REQUEUE,
    Preempted,
    PreemptionWatch,
    init_distributed,
    is_main_rank,
    shutdown_distributed,
)
from megatron_cascade.stages.rollout_scoring import build_domain_rewards
from megatron_cascade.cascade.stage import RunContext, StageRunner
from megatron_cascade.config import ConfigError, RunConfig, resolve_stage, to_yaml
from megatron_cascade.config.origins import ConfigOrigins
from megatron_cascade.run_logging import log_to_file
from megatron_cascade.cascade.plan import check_generation_layouts, uses_cuda_graphs
from megatron_cascade.model import initialize_model_parallel, resolve_layout
from megatron_cascade.tokenizers import build_tokenizer
from megatron_cascade.training.resume_checkpoint import write_atomically

log = logging.getLogger(__name__)


def build_run_tokenizer(cfg: RunConfig):
    """The run's tokenizer, checked against ``model.vocab_size``."""
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.chat_template_kwargs)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}; raise model.vocab_size")
    return tokenizer


def build_context(cfg: RunConfig, tokenizer=None, allowed_changes: Sequence[str] = ()) -> RunContext:
    """Tokenizer, manifest, eval sets and rewards for a run (distributed must be initialised);
    ``allowed_changes``: the run's ``--allow-config-change`` keys."""
    tokenizer = tokenizer if tokenizer is not None else build_run_tokenizer(cfg)
    eval_domains = sorted(d for d, spec in cfg.domains.items() if spec.eval)
    eval_sets = {d: load_examples(cfg.domains[d].eval, d, tokenizer, on_bad_row=cfg.data.on_bad_row,
                                  max_prompt_tokens=cfg.data.max_prompt_tokens,
                                  check_row=domain_row_check(d, cfg.domains[d])) for d in eval_domains}
    rewards = build_domain_rewards(cfg.domains, eval_domains)
    return RunContext(cfg, tokenizer, Manifest(cfg.output_dir),
                      PreemptionWatch(margin_s=cfg.checkpoint.time_limit_margin_s), eval_sets, rewards,
                      allowed_changes=tuple(allowed_changes))


def _write_run_files(cfg: RunConfig) -> None:
    os.makedirs(cfg.output_dir, exist_ok=True)
    write_atomically(os.path.join(cfg.output_dir, "config.yaml"), to_yaml(cfg))


def _check_and_record(cfg: RunConfig, allowed: Sequence[str]) -> None:
    """Refuse a resume that changes what started stages computed (``ConfigError``), else record the
    config in use (``config.yaml``) and the accepted changes (``manifest.json``). Rank 0, lock held."""
    changes = check_resume(cfg, allowed)
    used = [key for key in allowed if any(c.allowed_by([key]) for c in changes)]
    unused = [key for key in allowed if key not in used]
    if unused:  # a requeued job repeats its command line: the change was accepted (and recorded) before
        log.info("--allow-config-change %s: no such change since the recorded config", ",".join(unused))
    _write_run_files(cfg)
    if changes:
        log.warning("resuming with config changes accepted by --allow-config-change: %s",
                    "; ".join(str(c) for c in changes))
        Manifest(cfg.output_dir).record_config_change({c.key: {"recorded": c.recorded, "now": c.now}
                                                       for c in changes}, used)


def _from_rank0(text: str) -> str:
    """Rank 0's ``text`` on every rank (collective; CPU tensors: gloo carries them on GPU runs too)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0)
    if not is_main_rank():
        data = torch.zeros(int(size.item()), dtype=torch.uint8)
    if data.numel():
        dist.broadcast(data, src=0)
    return bytes(data.tolist()).decode()


def _prepare_output_dir(cfg: RunConfig, allowed: Sequence[str]) -> Optional[RunLock]:
    """Rank 0 locks ``output_dir`` (one run per directory) and checks the resume; every rank raises
    the same error when it refuses (rather than waiting in the next collective). Collective.
    Returns the lock on rank 0 (released by the caller when the run ends), None elsewhere."""
    lock, failure = None, None
    if is_main_rank():
        try:
            lock = acquire_run_lock(cfg.output_dir)
            _check_and_record(cfg, allowed)
        except Exception as exc:  # every kind, so that the other ranks learn it too
            failure = exc
            if lock is not None:
                lock.release()
                lock = None
    message = _from_rank0("" if failure is None else f"{type(failure).__name__}\n{failure}")
    if failure is not None:
        raise failure
    if message:
        kind, text = message.split("\n", 1)
        error = {"RunLockError": RunLockError, "ConfigError": ConfigError}.get(kind)
        raise error(text) if error else RuntimeError(f"rank 0 could not prepare {cfg.output_dir}: {kind}: {text}")
    return lock


def run_cascade(cfg: RunConfig, only_stage: str | None = None, allow_config_change: Sequence[str] = (),
                origins: Optional[ConfigOrigins] = None) -> int:
    """Run every incomplete stage (or only ``only_stage``); returns the process exit code
    (0 done, ``EXIT_REQUEUE`` after checkpointing on a preemption signal). ``origins``: where the
    config's values came from (the preflight's problems lead with it).

    The run holds ``output_dir``'s lock throughout (``RunLockError`` if another run holds it). A
    resume whose config changes what started stages computed raises ``ConfigError`` naming the keys,
    unless ``allow_config_change`` names them (dotted keys; recorded in the manifest).
    """
    init_distributed(cfg.distributed.timeout_minutes)
    lock = None
    try:
        tokenizer = build_run_tokenizer(cfg)
        preflight(cfg, tokenizer, only_stage, origins)  # every stage's data, --stage and its predecessors: nothing written
        layout = resolve_layout(cfg.model, cfg.parallel, dist.get_world_size())
        check_generation_layouts(cfg, layout)  # decode layouts, and CP only where a decode layout generates
        initialize_model_parallel(cfg.parallel, cfg.seed, timeout_minutes=cfg.distributed.timeout_minutes,
                                  cuda_graphs=uses_cuda_graphs(cfg))
        lock = _prepare_output_dir(cfg, allow_config_change)
        log_to_file(cfg.output_dir)
        if is_main_rank():
            log.info("layout: %s", layout)
        ctx = build_context(cfg, tokenizer, allow_config_change)
        names = [s.name for s in cfg.stages]
        if is_main_rank() and ctx.manifest.data.get("stage_order") != names:
            ctx.manifest.record("stage_order", names)
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
        try:
            shutdown_distributed()
        finally:
            if lock is not None:  # after every rank is done with the directory
                lock.release()
