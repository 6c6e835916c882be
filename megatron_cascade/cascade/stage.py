"""One stage of the cascade (sft, grpo or mopd): the step loop, checkpoints, final weights, evaluation.

Per step: draw prompts (domains mixed by weight, deterministic in (seed, step)), take this
data-parallel rank's share, generate G responses per prompt, score them, build advantages (GRPO)
or teacher log-probs (MOPD), one optimizer step (``training.optimize_on_batch``), log, checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_cascade.algorithms import apply_overlong_policy, group_advantages, informative_groups
from megatron_cascade.cascade.batches import rollout_batch, sft_batch
from megatron_cascade.cascade.data import Example, PromptMixer, load_examples
from megatron_cascade.cascade.evaluation import data_parallel, evaluate
from megatron_cascade.cascade.logger import StageLogger
from megatron_cascade.cascade.manifest import Manifest, checkpoint_root, stage_dir
from megatron_cascade.cascade.runtime import Preempted, PreemptionWatch, is_main_rank
from megatron_cascade.cascade.scoring import RolloutScorer, build_domain_rewards, check_error_fraction
from megatron_cascade.cascade.teachers import TOKENIZER_FINGERPRINT_FILE, TeacherPool, teacher_logprobs
from megatron_cascade.config.model import ConfigError
from megatron_cascade.config.schema import ResolvedStage, RunConfig
from megatron_cascade.model import build_gpt_model
from megatron_cascade.rollout import KVCacheConfig, SamplingParams, generate
from megatron_cascade.training import LossSpec, TrainBatch, build_policy, forward_logprobs, optimize_on_batch
from megatron_cascade.training.checkpoint import (
    load_training_checkpoint,
    read_latest,
    save_final_weights,
    save_training_checkpoint,
)
from megatron_cascade.training.policy import finish_param_sync, in_model_precision, load_policy_weights

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


def _reseed(seed: int) -> None:
    """Same RNG state at a stage's start whatever ran before it in this process (resume = fresh run)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def start_weights(ctx: RunContext, index: int) -> str | None:
    """Where stage ``index`` starts from: the previous stage's final weights, or init_checkpoint."""
    if index == 0:
        return ctx.cfg.init_checkpoint
    previous = ctx.cfg.stages[index - 1].name
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


def stage_loss_spec(stage: ResolvedStage, vocab_size: int) -> LossSpec:
    """What the stage trains on: RL stages take log-probs of the distribution the rollouts were sampled
    from (temperature, top-k, top-p of ``rollout``); SFT of the plain softmax. Greedy rollouts
    (temperature 0) train at temperature 1 without truncation."""
    r = stage.rollout
    if stage.type == "sft" or r.temperature <= 0:
        return LossSpec(stage.type, stage.loss, temperature=1.0, vocab_size=vocab_size)
    return LossSpec(stage.type, stage.loss, temperature=r.temperature, vocab_size=vocab_size, top_k=r.top_k,
                    top_p=r.top_p)


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
        self.spec = stage_loss_spec(stage, self.tok.vocab_size)
        self.ckpt_root = checkpoint_root(self.cfg.output_dir, stage.name)

    # -- setup ---------------------------------------------------------------------------------
    def _build(self) -> int:
        _reseed(self.cfg.seed + 1000 * self.index)
        # The lr schedule counts optimizer steps: ppo_epochs of them per stage step.
        optimizer_steps = self.stage.steps * self.stage.training.ppo_epochs
        self.policy = build_policy(self.cfg.model, self.cfg.parallel, self.stage.optimizer, optimizer_steps)
        self.start_path = start_weights(self.ctx, self.index)
        if self.start_path is not None:
            load_policy_weights(self.policy, self.start_path)  # fp32 masters too, not only the model
        # The KL reference is the stage's start, taken before a resume overwrites the policy.
        self.reference = self._reference_model()
        latest = read_latest(self.ckpt_root)
        first_step = 0
        if latest is not None:
            state = load_training_checkpoint(latest, self.policy)
            log.info("stage %s: resuming from %s (step %d)", self.stage.name, latest, state["step"])
            first_step = int(state["step"])
        sft = self.stage.type == "sft"
        self.datasets = {d: load_examples(self._data_file(d), d, self.tok, on_bad_row=self.cfg.data.on_bad_row,
                                          need_response=sft, max_prompt_tokens=self.cfg.data.max_prompt_tokens)
                         for d in self.stage.domains}
        self.mixer = PromptMixer(self.datasets, self.stage.domains, seed=self.cfg.seed + 7919 * self.index)
        self.rewards = build_domain_rewards(self.cfg.domains, self.stage.domains) if self.stage.type != "sft" else {}
        self.teachers = None
        if self.stage.type == "mopd":
            self.teachers = TeacherPool(teacher_paths(self.ctx, self.stage), self.cfg.model, self.cfg.parallel,
                                        self.tok.fingerprint())
        return first_step

    def _data_file(self, domain: str) -> str:
        spec = self.cfg.domains[domain]
        return (spec.sft or spec.train) if self.stage.type == "sft" else spec.train

    def _reference_model(self):
        """Frozen stage-start weights for the KL term (only when loss.kl_coef > 0)."""
        if self.stage.type != "grpo" or self.stage.loss.kl_coef == 0:
            return None
        model = in_model_precision(build_gpt_model(self.cfg.model, self.cfg.parallel), self.cfg.model).eval()
        model.load_state_dict(self.policy.module.state_dict())
        for param in model.parameters():
            param.requires_grad_(False)
        return model

    # -- loop ----------------------------------------------------------------------------------
    def run(self, global_offset: int) -> dict:
        first_step = self._build()
        logging_cfg = self.cfg.logging
        logger = StageLogger(self.cfg.output_dir, self.stage.name, self.stage.steps, first_step, global_offset,
                             logging_cfg.tensorboard, logging_cfg.progress_bar)
        try:
            for step in range(first_step, self.stage.steps):
                metrics = self._step(step)
                logger.log_step(step, metrics)
                self._maybe_checkpoint(step + 1)
            record = self._finish(logger)
        finally:
            logger.close()
        return record

    def _maybe_checkpoint(self, done: int) -> None:
        every = self.cfg.checkpoint.every_steps
        if self.ctx.preemption.requested():
            save_training_checkpoint(self.ckpt_root, done, self.policy, {"stage": self.stage.name},
                                     self.cfg.checkpoint.keep_last)
            raise Preempted(f"stage {self.stage.name}: checkpointed at step {done} on a preemption signal "
                            "or before the job's time limit")
        if every and done % every == 0 and done < self.stage.steps:
            save_training_checkpoint(self.ckpt_root, done, self.policy, {"stage": self.stage.name},
                                     self.cfg.checkpoint.keep_last)

    def _my_share(self, step: int) -> list[Example]:
        examples = self.mixer.draw(step, self.stage.prompts_per_step)
        per_rank = self.stage.prompts_per_step // self.dp_size
        return examples[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]

    def _step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        examples = self._my_share(step)
        if self.stage.type == "sft":
            batch, sums, timing = sft_batch(examples, self.tok), {}, {}
        else:
            batch, sums, timing = self._rollout_step(step, examples)
        train_start = time.perf_counter()
        metrics = optimize_on_batch(self.policy, batch, self.spec, self.stage.training)
        timing["time/train_s"] = time.perf_counter() - train_start
        sums["tokens_processed"] = float(batch.input_ids.numel())
        metrics.update(self._reduce(sums))
        elapsed = time.perf_counter() - start
        metrics.update(timing)
        metrics["time/step_s"] = elapsed
        metrics["throughput/tokens_per_s"] = metrics.pop("tokens_processed") / elapsed
        return metrics

    def _sampling(self, step: int, n: int) -> SamplingParams:
        r = self.stage.rollout
        seed = (self.cfg.seed * 1_000_003 + self.index * 10_007 + step) * 131 + self.dp_rank
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              stop_strings=tuple(r.stop_strings), n=n, seed=seed)

    def _rollout_step(self, step: int, examples: list[Example]):
        G = self.stage.samples_per_prompt
        t0 = time.perf_counter()
        finish_param_sync(self.policy)  # generation reads the weights of the last step
        # Each sample is scored the moment it finishes, while the others decode on.
        with RolloutScorer(self.rewards, self.cfg.domains, self.tok, [e.row for e in examples],
                           [e.domain for e in examples]) as scorer:
            rollouts = generate(self.policy.module, [list(e.prompt_ids) for e in examples], self._sampling(step, G),
                                tokenizer=self.tok, kv_cache=KVCacheConfig.from_rollout(self.stage.rollout),
                                on_finished=scorer.on_finished)
            gen_s = time.perf_counter() - t0
            scores, errored, reward_s = scorer.collect_flags(rollouts.samples)  # reward_s: the stragglers only
        domains = [examples[s.prompt_index].domain for s in rollouts]
        # Before anything is trained on this step: every rank stops if the rewards largely failed.
        check_error_fraction(errored, domains, self.cfg.domains, list(self.stage.domains),
                             self.cfg.rewards.max_error_frac, self.dp_group)
        finished = torch.tensor([s.finish_reason == "stop" for s in rollouts])
        rewards = scores.view(len(examples), G)
        rewards, keep = apply_overlong_policy(rewards, finished.view(len(examples), G),
                                              policy=self.stage.rollout.overlong_policy)
        # A failed reward's 0 is not a verdict on the response: the sample leaves the loss, the
        # normaliser and its group's advantage statistics (GRPO) / the distillation loss (MOPD).
        keep = keep & ~errored.view(len(examples), G)
        sums = self._rollout_sums(rollouts, scores, domains, errored)
        if self.stage.type == "grpo":
            batch = self._grpo_batch(rollouts, rewards, keep, sums)
        else:
            batch = rollout_batch(rollouts, self.tok, keep=keep.flatten(), advantages=None,
                                  truncated=self.spec.truncated)
            batch.teacher_logprobs = self._teacher_logprobs(batch, domains)
        timing = {"time/generation_s": gen_s, "time/reward_s": reward_s}
        return batch, sums, timing

    def _grpo_batch(self, rollouts, rewards: torch.Tensor, keep: torch.Tensor, sums: dict) -> TrainBatch:
        r = self.stage.rollout
        advantages = group_advantages(rewards, std_normalize=r.std_normalize_advantages, baseline=r.advantage_baseline,
                                      std=r.advantage_std, valid=keep)
        informative = informative_groups(rewards, valid=keep)
        sums["groups"] = float(rewards.shape[0])
        sums["groups_informative"] = float(informative.sum())
        if r.filter_uninformative_groups:
            keep = keep & informative.unsqueeze(1)
        sums["advantage_abs_sum"] = float((advantages.abs() * keep).sum())
        batch = rollout_batch(rollouts, self.tok, keep=keep.flatten(), advantages=advantages.flatten().float(),
                              truncated=self.spec.truncated)
        if self.reference is not None:
            batch.ref_logprobs = forward_logprobs([self.reference], batch, self.spec,
                                                  self.stage.training.micro_batch_size)
        return batch

    def _teacher_logprobs(self, batch: TrainBatch, domains: list[str]) -> torch.Tensor:
        # A teacher is a reference distribution, not the sampler: its log-probs are not truncated.
        spec = dataclasses.replace(self.spec, top_k=0, top_p=1.0)
        return teacher_logprobs(self.teachers, batch, domains, spec, self.stage.training.micro_batch_size)

    def _rollout_sums(self, rollouts, scores: torch.Tensor, domains: list[str],
                      errored: torch.Tensor) -> dict[str, float]:
        """Step sums of this rank; reward means count only samples whose reward did not fail."""
        lengths = [len(s.response_ids) for s in rollouts]
        scored = ~errored
        sums = {"reward_sum": float(scores[scored].sum()), "samples": float(len(rollouts)),
                "reward_errors": float(errored.sum()), "response_length_sum": float(sum(lengths)),
                "finish_stop": float(sum(s.finish_reason == "stop" for s in rollouts))}
        for domain in self.stage.domains:
            picked = [float(scores[i]) for i, d in enumerate(domains) if d == domain and scored[i]]
            sums[f"reward_sum/{domain}"] = sum(picked)
            sums[f"scored/{domain}"] = float(len(picked))
        return sums

    def _reduce(self, sums: dict[str, float]) -> dict[str, float]:
        """All-reduce step sums over data-parallel ranks and turn them into logged means."""
        if not sums:
            return {}
        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(values, group=self.dp_group)
        total = dict(zip(keys, values.tolist()))
        out = {"tokens_processed": total.pop("tokens_processed")}
        samples = total.get("samples")
        if samples:
            scored = samples - total["reward_errors"]
            out["reward/mean"] = total["reward_sum"] / scored if scored else 0.0
            out["reward/errors"] = total["reward_errors"]
            out["reward/error_frac"] = total["reward_errors"] / samples
            out["response/length_mean"] = total["response_length_sum"] / samples
            out["finish/stop_frac"] = total["finish_stop"] / samples
            out["finish/length_frac"] = 1.0 - out["finish/stop_frac"]
            for domain in self.stage.domains:
                n = total.get(f"scored/{domain}", 0.0)
                if n:
                    out[f"reward/{domain}"] = total[f"reward_sum/{domain}"] / n
        if "groups" in total:
            out["groups/informative_frac"] = total["groups_informative"] / max(total["groups"], 1.0)
            out["advantage/abs_mean"] = total["advantage_abs_sum"] / max(samples or 1.0, 1.0)
        return out

    # -- end -----------------------------------------------------------------------------------
    def _finish(self, logger: StageLogger) -> dict:
        final = os.path.join(stage_dir(self.cfg.output_dir, self.stage.name), "final")
        save_final_weights(final, self.policy, {TOKENIZER_FINGERPRINT_FILE: self.tok.fingerprint() + "\n"})
        scores = self._evaluate()
        logger.log_eval(scores, self.stage.steps)
        record = {
            "status": "complete",
            "type": self.stage.type,
            "steps": self.stage.steps,
            "domains": dict(self.stage.domains),
            "final_weights": os.path.relpath(final, self.cfg.output_dir),
            "eval": scores,
        }
        if self.stage.teachers:
            record["teachers"] = dict(self.stage.teachers)
        if is_main_rank():
            self.ctx.manifest.record_stage(self.stage.name, record)
        dist.barrier()
        return record

    def _evaluate(self) -> dict[str, float]:
        eval_cfg = self.cfg.eval
        if not eval_cfg.enabled or not self.ctx.eval_sets:
            return {}
        finish_param_sync(self.policy)
        return evaluate(self.policy.module, self.ctx.eval_sets, self.ctx.eval_rewards, self.cfg.domains, self.tok,
                        eval_cfg, self.cfg.rollout, seed=self.cfg.seed)
