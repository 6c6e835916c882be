"""One stage of the cascade: the step loop, checkpoints, final weights, evaluation.

Per step: draw prompts (domains mixed by weight, deterministic in (seed, step)), take this
data-parallel rank's share, let the stage type build the batch (``stages/``: SFT targets; or
generate G responses per prompt, score them, advantages (GRPO) or teacher log-probs (MOPD,
distill)), one optimizer step (``training.optimize_on_batch``), log, checkpoint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_cascade.stages.prompt_data import Example, PromptMixer, load_examples
from megatron_cascade.environments.settings import domain_row_check
from megatron_cascade.cascade.evaluation import DomainEval, data_parallel, evaluate_detailed
from megatron_cascade.cascade.logger import StageLogger
from megatron_cascade.cascade.manifest import Manifest, checkpoint_root, stage_dir
from megatron_cascade.cascade.runtime import Preempted, PreemptionWatch, is_main_rank
from megatron_cascade.cascade.step_metrics import rollout_metrics
from megatron_cascade.stages.teachers import TOKENIZER_FINGERPRINT_FILE
from megatron_cascade.config.model import ConfigError, DecodeParallelConfig
from megatron_cascade.config.loader import start_stage
from megatron_cascade.config.schema import ResolvedStage, RunConfig
from megatron_cascade.stages import stage_class
from megatron_cascade.config.stage_types import stage_type
from megatron_cascade.training import build_policy, optimize_on_batch
from megatron_cascade.training.resume_checkpoint import (
    agreed_latest,
    load_training_checkpoint,
    save_final_weights,
    save_training_checkpoint,
)
from megatron_cascade.rollout.replica_groups import GenerationReplica
from megatron_cascade.training.decode_copy import DecodeCopy
from megatron_cascade.training.policy import finish_param_sync, load_policy_weights
from megatron_cascade.training.state_offload import TrainingStateOffload

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What every stage of a run shares."""

    cfg: RunConfig
    tokenizer: object
    manifest: Manifest
    preemption: PreemptionWatch
    eval_sets: dict[str, list[Example]]
    eval_rewards: dict
    # --allow-config-change keys of this run (``data.contents``: resume on rewritten data files).
    allowed_changes: tuple[str, ...] = ()
    # Decode copies of the policy by layout (``rollout.parallel``): built once, refit by every stage.
    decode_copies: dict = field(default_factory=dict)

    def decode_copy(self, decode: DecodeParallelConfig, cuda_graphs: bool = False) -> DecodeCopy:
        """The decode copy at ``decode``'s layout, with CUDA graph managers or not (built on first use;
        collective)."""
        key = (decode.tensor_model_parallel_size, decode.expert_model_parallel_size, decode.expert_tensor_parallel_size,
               cuda_graphs)
        if key not in self.decode_copies:
            self.decode_copies[key] = DecodeCopy(self.cfg.model, decode, cuda_graphs=cuda_graphs,
                                                 timeout_minutes=self.cfg.distributed.timeout_minutes)
        return self.decode_copies[key]


def _reseed(seed: int) -> None:
    """Same RNG state at a stage's start whatever ran before it in this process (resume = fresh run)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def start_weights(ctx: RunContext, index: int) -> str | None:
    """Where stage ``index`` starts from: its ``init_from`` stage's final weights (default: the
    previous stage's), or init_checkpoint for the first stage."""
    previous = start_stage(ctx.cfg, index)
    if previous is None:
        return ctx.cfg.init_checkpoint
    path = ctx.manifest.final_weights(previous)
    if path is None:
        raise RuntimeError(f"stage {ctx.cfg.stages[index].name!r} starts from stage {previous!r}, "
                           f"which is not complete in {ctx.manifest.path}; run the cascade in order")
    return path


def teacher_paths(ctx: RunContext, stage: ResolvedStage) -> dict[str, str]:
    """MOPD teachers as weights folders: an earlier stage's final weights, or a given folder."""
    out = {}
    for domain, teacher in stage.teachers.items():
        if teacher in {s.name for s in ctx.cfg.stages}:
            path = ctx.manifest.final_weights(teacher)
            if path is None:
                raise ConfigError(f"stage {stage.name!r}: teachers.{domain}={teacher!r} is not a complete stage yet")
            out[domain] = path
        else:
            out[domain] = teacher
    return out


class StageRunner:
    """Runs one resolved stage to completion (resuming from its last checkpoint if there is one)."""

    def __init__(self, ctx: RunContext, index: int, stage: ResolvedStage) -> None:
        self.ctx, self.index, self.stage = ctx, index, stage
        self.cfg = ctx.cfg
        self.tok = ctx.tokenizer
        self.dp_rank, self.dp_size, self.dp_group = data_parallel()
        if stage.prompts_per_step % self.dp_size:
            raise ConfigError(f"stage {stage.name!r}: prompts_per_step={stage.prompts_per_step} is not divisible "
                              f"by the data-parallel size {self.dp_size}")
        self.kind = stage_class(stage.type)(self)
        self.spec = self.kind.loss_spec(self.tok.vocab_size)
        self.ckpt_root = checkpoint_root(self.cfg.output_dir, stage.name)
        self.refit_seconds = 0.0  # decode-copy refits, summed over a step (``time/refit_s``)

    # -- setup ---------------------------------------------------------------------------------
    def _build(self) -> int:
        _reseed(self.cfg.seed + 1000 * self.index)
        # The lr schedule counts optimizer steps: ppo_epochs of them per stage step.
        optimizer_steps = self.stage.steps * self.stage.training.ppo_epochs
        self.policy = build_policy(self.cfg.model, self.cfg.parallel, self.stage.optimizer, optimizer_steps)
        self.state_offload = TrainingStateOffload(self.policy)
        self.start_path = start_weights(self.ctx, self.index)
        if self.start_path is not None:
            load_policy_weights(self.policy, self.start_path)  # fp32 masters too, not only the model
        self.kind.setup()  # before a resume overwrites the policy: a KL reference is the stage's start
        digests = {d: hashlib.sha256() for d in self.stage.domains}  # fed by the one read of each file
        self.datasets = {d: load_examples(self.kind.data_file(d), d, self.tok, on_bad_row=self.cfg.data.on_bad_row,
                                          need_response=self.kind.needs_response,
                                          max_prompt_tokens=self.cfg.data.max_prompt_tokens, digest=digests[d],
                                          check_row=domain_row_check(d, self.cfg.domains[d])
                                          if self.kind.runs_episodes else None)
                         for d in self.stage.domains}
        self.data_record = {d: {"path": self.kind.data_file(d), "sha256": digests[d].hexdigest()}
                            for d in self.stage.domains}
        latest = agreed_latest(self.ckpt_root)  # rank 0's view: ranks on other nodes may lag
        first_step = 0
        if latest is not None:
            state = load_training_checkpoint(latest, self.policy)
            log.info("stage %s: resuming from %s (step %d)", self.stage.name, latest, state["step"])
            first_step = int(state["step"])
            self._check_data_unchanged(state.get("data") or {}, first_step)
        self.mixer = PromptMixer(self.datasets, self.stage.domains, seed=self.cfg.seed + 7919 * self.index)
        return first_step

    def _check_data_unchanged(self, recorded: dict, step: int) -> None:
        """Refuse to resume on a data file whose contents changed since the checkpoint (the steps after
        the resume would draw other rows than a run that never stopped), unless the run allows
        ``data.contents`` (``--allow-config-change``)."""
        changed = [f"domains.{d} ({now['path']}: SHA-256 {recorded[d]['sha256'][:12]} recorded, {now['sha256'][:12]} "
                   "now)" for d, now in self.data_record.items()
                   if d in recorded and recorded[d].get("sha256") != now["sha256"]]
        if not changed:
            return
        if any(key in ("data", "data.contents") for key in self.ctx.allowed_changes):
            log.warning("stage %s: resuming on changed data (--allow-config-change data.contents): %s",
                        self.stage.name, "; ".join(changed))
            return
        raise ConfigError(f"stage {self.stage.name}: its checkpoint at step {step} was taken on other data: "
                          f"{'; '.join(changed)}. Restore the files, or resume on the new rows with "
                          "--allow-config-change data.contents")

    def generation_replica(self) -> GenerationReplica:
        """What generates this stage's rollouts and evaluations, holding the policy's current weights:
        the decode copy at ``rollout.parallel`` (refit now; collective), else the policy itself. With
        ``rollout.offload_training_state`` the policy's gradients and optimizer state (and its weights,
        when the copy generates) go to host memory until ``generation_done``."""
        finish_param_sync(self.policy)  # generation reads the weights of the last step
        decode = self.stage.rollout.parallel
        if decode is None:
            replica = GenerationReplica.training(self.policy.module)
        else:
            copy = self._decode_copy()
            copy.refit(self.policy)
            self.refit_seconds += copy.refit_seconds
            replica = copy.replica
        if self.stage.rollout.offload_training_state:  # the copy was refit: the policy's weights may go too
            self.state_offload.offload(weights=decode is not None)
        return replica

    def generation_done(self) -> None:
        """Generation is over until the next step or evaluation: the training state comes back, the
        decode copy's weights are freed (training takes the memory; the next ``generation_replica``
        refits them)."""
        if self.stage.rollout.parallel is not None:
            self._decode_copy().release()
        self.state_offload.restore()

    def _decode_copy(self) -> DecodeCopy:
        rollout = self.stage.rollout
        return self.ctx.decode_copy(rollout.parallel, cuda_graphs=rollout.cuda_graphs is not None)

    def teacher_paths(self) -> dict[str, str]:
        """This stage's teachers as weights folders (see :func:`teacher_paths`)."""
        return teacher_paths(self.ctx, self.stage)

    # -- loop ----------------------------------------------------------------------------------
    def run(self, global_offset: int) -> dict:
        first_step = self._build()
        logging_cfg = self.cfg.logging
        logger = StageLogger(self.cfg.output_dir, self.stage.name, self.stage.steps, first_step, global_offset,
                             logging_cfg.tensorboard, logging_cfg.progress_bar)
        try:
            for step in range(first_step, self.stage.steps):
                metrics = self._step(step)
                metrics.update(self._periodic_eval(step + 1))
                logger.log_step(step, metrics)
                self._maybe_checkpoint(step + 1)
            record = self._finish(logger)
        finally:
            logger.close()
        return record

    def _maybe_checkpoint(self, done: int) -> None:
        every = self.cfg.checkpoint.every_steps
        if self.ctx.preemption.requested():
            save_training_checkpoint(self.ckpt_root, done, self.policy, self._checkpoint_state(),
                                     self.cfg.checkpoint.keep_last)
            raise Preempted(f"stage {self.stage.name}: checkpointed at step {done} on a preemption signal "
                            "or before the job's time limit")
        if every and done % every == 0 and done < self.stage.steps:
            save_training_checkpoint(self.ckpt_root, done, self.policy, self._checkpoint_state(),
                                     self.cfg.checkpoint.keep_last)

    def _checkpoint_state(self) -> dict:
        """What a checkpoint records besides the tensors: the stage, and each data file's digest."""
        return {"stage": self.stage.name, "data": self.data_record}

    def my_share(self, step: int, round: int = 0) -> list[Example]:
        """This data-parallel rank's prompts of ``step`` (``round`` > 0: dynamic sampling's further draws)."""
        examples = self.mixer.draw(step, self.stage.prompts_per_step, round)
        per_rank = self.stage.prompts_per_step // self.dp_size
        return examples[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]

    def _step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        self.refit_seconds = self.state_offload.seconds = 0.0
        made = self.kind.make_batch(step, self.my_share(step))
        train_start = time.perf_counter()
        metrics = optimize_on_batch(self.policy, made.batch, self.spec, self.stage.training)
        made.timing["time/train_s"] = time.perf_counter() - train_start
        made.sums["tokens_processed"] = float(made.batch.input_ids.numel())
        metrics.update(self._reduce(made.sums, made.maxes))
        self.kind.step_done(metrics)
        elapsed = time.perf_counter() - start
        metrics.update(made.timing)
        if self.stage.rollout.parallel is not None and stage_type(self.stage.type).generates:
            metrics["time/refit_s"] = self.refit_seconds
        if self.stage.rollout.offload_training_state and stage_type(self.stage.type).generates:
            metrics["time/offload_s"] = self.state_offload.seconds
        metrics["time/step_s"] = elapsed
        tokens = metrics.pop("tokens_processed")
        metrics["throughput/tokens_per_s"] = tokens / elapsed
        metrics["throughput/tokens_per_s_per_gpu"] = tokens / elapsed / dist.get_world_size()
        return metrics

    def _reduce(self, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
        """All-reduce step sums (and maxima) over data-parallel ranks and turn them into logged metrics."""
        if not sums:
            return {}
        total = _all_reduce_dict(sums, dist.ReduceOp.SUM, self.dp_group)
        out = {"tokens_processed": total.pop("tokens_processed")}
        if "groups" in total:
            peaks = _all_reduce_dict(maxes, dist.ReduceOp.MAX, self.dp_group)
            out.update(rollout_metrics(total, peaks, self.stage.prompts_per_step, dict(self.stage.teachers)))
        return out

    # -- end -----------------------------------------------------------------------------------
    def _finish(self, logger: StageLogger) -> dict:
        final = os.path.join(stage_dir(self.cfg.output_dir, self.stage.name), "final")
        save_final_weights(final, self.policy, {TOKENIZER_FINGERPRINT_FILE: self.tok.fingerprint() + "\n"})
        details = self._evaluate()
        scores = {domain: result.score for domain, result in details.items()}
        logger.log_eval(scores, self.stage.steps)
        record = {
            "status": "complete",
            "type": self.stage.type,
            "steps": self.stage.steps,
            "domains": dict(self.stage.domains),
            "final_weights": os.path.relpath(final, self.cfg.output_dir),
            "eval": scores,
        }
        if details:  # the standard error over prompts and pass@k of each score (k = eval.samples)
            record["eval_se"] = {domain: result.se for domain, result in details.items()}
            record["eval_pass_at_k"] = {domain: result.pass_at_k for domain, result in details.items()}
            record["eval_k"] = self.cfg.eval.samples
        if self.stage.teachers:
            record["teachers"] = dict(self.stage.teachers)
        if self.index > 0:  # the stage whose weights this one started from (the report's deltas)
            record["init_from"] = self.cfg.stages[self.index].init_from or self.cfg.stages[self.index - 1].name
        if is_main_rank():
            self.ctx.manifest.record_stage(self.stage.name, record)
        dist.barrier()
        return record

    def _evaluate(self, domains: list[str] | None = None) -> dict[str, DomainEval]:
        """Held-out results of the current weights on ``domains`` (None: every eval set); collective."""
        eval_cfg = self.cfg.eval
        eval_sets = {d: e for d, e in self.ctx.eval_sets.items() if domains is None or d in domains}
        if not eval_cfg.enabled or not eval_sets:
            return {}
        try:
            return evaluate_detailed(self.generation_replica(), eval_sets, self.ctx.eval_rewards, self.cfg.domains,
                                     self.tok, eval_cfg, self.cfg.rollout, seed=self.cfg.seed,
                                     generation_wait_minutes=self.cfg.distributed.generation_wait_minutes)
        finally:
            self.generation_done()

    def _periodic_eval(self, done: int) -> dict[str, float]:
        """``eval.every_steps``: in a stage that generates (RL, distillation; not SFT), after every that
        many steps (not the last: the stage's own eval follows), the held-out score and its standard
        error on the stage's domains, as step metrics."""
        every = self.cfg.eval.every_steps
        if not every or done % every or done >= self.stage.steps or not stage_type(self.stage.type).generates:
            return {}
        details = self._evaluate(list(self.stage.domains))
        out = {f"eval/{domain}": result.score for domain, result in details.items()}
        out.update({f"eval_se/{domain}": result.se for domain, result in details.items()})
        return out


def _all_reduce_dict(values: dict[str, float], op, group) -> dict[str, float]:
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(tensor, op=op, group=group)
    return dict(zip(keys, tensor.tolist()))
