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
from megatron_cascade.cascade.groups import GroupRound, merge_groups, select_groups
from megatron_cascade.cascade.step_metrics import rollout_metrics
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

    def _my_share(self, step: int, round: int = 0) -> list[Example]:
        examples = self.mixer.draw(step, self.stage.prompts_per_step, round)
        per_rank = self.stage.prompts_per_step // self.dp_size
        return examples[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]

    def _step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        examples = self._my_share(step)
        if self.stage.type == "sft":
            batch, sums, maxes, timing = sft_batch(examples, self.tok), {}, {}, {}
        else:
            batch, sums, maxes, timing = self._rollout_step(step, examples)
        train_start = time.perf_counter()
        metrics = optimize_on_batch(self.policy, batch, self.spec, self.stage.training)
        timing["time/train_s"] = time.perf_counter() - train_start
        sums["tokens_processed"] = float(batch.input_ids.numel())
        metrics.update(self._reduce(sums, maxes))
        elapsed = time.perf_counter() - start
        metrics.update(timing)
        metrics["time/step_s"] = elapsed
        tokens = metrics.pop("tokens_processed")
        metrics["throughput/tokens_per_s"] = tokens / elapsed
        metrics["throughput/tokens_per_s_per_gpu"] = tokens / elapsed / dist.get_world_size()
        return metrics

    def _sampling(self, step: int, n: int, round: int = 0) -> SamplingParams:
        r = self.stage.rollout
        seed = (self.cfg.seed * 1_000_003 + self.index * 10_007 + step) * 131 + self.dp_rank + round * 7_368_787
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              stop_strings=tuple(r.stop_strings), n=n, seed=seed)

    def _generate_round(self, step: int, round: int, examples: list[Example], timing: dict) -> GroupRound:
        """Generate G responses per prompt, score them (while decoding), apply the overlong policy."""
        G = self.stage.samples_per_prompt
        t0 = time.perf_counter()
        finish_param_sync(self.policy)  # generation reads the weights of the last step
        # Each sample is scored the moment it finishes, while the others decode on.
        with RolloutScorer(self.rewards, self.cfg.domains, self.tok, [e.row for e in examples],
                           [e.domain for e in examples]) as scorer:
            rollouts = generate(self.policy.module, [list(e.prompt_ids) for e in examples],
                                self._sampling(step, G, round), tokenizer=self.tok,
                                kv_cache=KVCacheConfig.from_rollout(self.stage.rollout), on_finished=scorer.on_finished)
            timing["time/generation_s"] += time.perf_counter() - t0
            scores, errored, reward_s = scorer.collect_flags(rollouts.samples)  # reward_s: the stragglers only
            timing["time/reward_s"] += reward_s
        domains = [examples[s.prompt_index].domain for s in rollouts]
        # Before anything is trained on this step: every rank stops if the rewards largely failed.
        check_error_fraction(errored, domains, self.cfg.domains, list(self.stage.domains),
                             self.cfg.rewards.max_error_frac, self.dp_group)
        finished = torch.tensor([s.finish_reason == "stop" for s in rollouts])
        rewards, keep = apply_overlong_policy(scores.view(len(examples), G), finished.view(len(examples), G),
                                              policy=self.stage.rollout.overlong_policy)
        # A failed reward's 0 is not a verdict on the response: the sample leaves the loss, the
        # normaliser and its group's advantage statistics (GRPO) / the distillation loss (MOPD).
        keep = keep & ~errored.view(len(examples), G)
        return GroupRound(examples, rollouts, scores, errored, rewards, keep, informative_groups(rewards, valid=keep))

    def _generate_groups(self, step: int, examples: list[Example], timing: dict) -> list[GroupRound]:
        """Round 0 on ``examples``; with dynamic sampling further rounds on further prompts until every
        rank has its share of informative groups (decided on all data-parallel ranks together)."""
        rounds = [self._generate_round(step, 0, examples, timing)]
        quota = len(examples)
        while len(rounds) < self.stage.rollout.dynamic_sampling_max_rounds:
            found = sum(int(r.informative.sum()) for r in rounds)
            have = torch.tensor([float(min(found, quota))], dtype=torch.float64)
            dist.all_reduce(have, group=self.dp_group)
            if have.item() >= self.stage.prompts_per_step:
                break
            rounds.append(self._generate_round(step, len(rounds), self._my_share(step, len(rounds)), timing))
        return rounds

    def _rollout_step(self, step: int, examples: list[Example]):
        timing = {"time/generation_s": 0.0, "time/reward_s": 0.0}
        rounds = self._generate_groups(step, examples, timing)
        dynamic = self.stage.rollout.dynamic_sampling_max_rounds > 1
        chosen = merge_groups(rounds, select_groups(rounds, len(examples), informative_first=dynamic))
        sums, maxes = self._rollout_sums(rounds)
        if self.stage.type == "grpo":
            batch = self._grpo_batch(chosen, sums, timing)
        else:
            batch = rollout_batch(chosen.rollouts, self.tok, keep=chosen.keep.flatten(), advantages=None,
                                  truncated=self.spec.truncated)
            t0 = time.perf_counter()
            batch.teacher_logprobs = self._teacher_logprobs(batch, chosen.sample_domains)
            timing["time/teacher_s"] = time.perf_counter() - t0
            sums.update(self._reverse_kl_sums(batch, chosen.sample_domains))
        return batch, sums, maxes, timing

    def _grpo_batch(self, chosen: GroupRound, sums: dict, timing: dict) -> TrainBatch:
        r = self.stage.rollout
        keep = chosen.keep
        advantages = group_advantages(chosen.rewards, std_normalize=r.std_normalize_advantages,
                                      baseline=r.advantage_baseline, std=r.advantage_std, valid=keep)
        if r.filter_uninformative_groups:
            keep = keep & chosen.informative.unsqueeze(1)
        sums["groups_trained"] = float(chosen.informative.sum())
        sums["advantage_abs_sum"] = float((advantages.abs() * keep).sum())
        sums["samples_trained"] = float(keep.sum())
        batch = rollout_batch(chosen.rollouts, self.tok, keep=keep.flatten(), advantages=advantages.flatten().float(),
                              truncated=self.spec.truncated)
        if self.reference is not None:
            t0 = time.perf_counter()
            batch.ref_logprobs = forward_logprobs([self.reference], batch, self.spec,
                                                  self.stage.training.micro_batch_size)
            timing["time/reference_s"] = time.perf_counter() - t0
        return batch

    def _teacher_logprobs(self, batch: TrainBatch, domains: list[str]) -> torch.Tensor:
        # A teacher is a reference distribution, not the sampler: its log-probs are not truncated.
        spec = dataclasses.replace(self.spec, top_k=0, top_p=1.0)
        return teacher_logprobs(self.teachers, batch, domains, spec, self.stage.training.micro_batch_size)

    def _reverse_kl_sums(self, batch: TrainBatch, sample_domains: list[str]) -> dict[str, float]:
        """Per domain (one teacher each), sums of the sampled-token reverse KL estimate
        log pi_infer(y) - log pi_teacher(y) over loss tokens, and the token counts."""
        per_token = (batch.inference_logprobs - batch.teacher_logprobs) * batch.loss_mask
        per_row, tokens = per_token.sum(dim=1), batch.loss_mask.sum(dim=1)
        sums = {}
        for domain in self.stage.domains:
            rows = [i for i, d in enumerate(sample_domains) if d == domain]
            sums[f"mopd_rkl_sum/{domain}"] = float(per_row[rows].sum()) if rows else 0.0
            sums[f"mopd_tokens/{domain}"] = float(tokens[rows].sum()) if rows else 0.0
        return sums

    def _rollout_sums(self, rounds: list[GroupRound]) -> tuple[dict[str, float], dict[str, float]]:
        """Step sums (and maxima) of this rank over every generated sample of every round; reward
        statistics count only samples whose reward did not fail, after the overlong policy (the
        rewards advantages see; ``reward/raw_mean``: the verifiers' scores before it)."""
        sums: dict[str, float] = {"groups": 0.0, "groups_informative": 0.0}
        longest = 0.0
        for rnd in rounds:
            scored = ~rnd.errored
            reward = rnd.rewards.flatten().to(torch.float64)
            lengths = torch.tensor([float(len(s.response_ids)) for s in rnd.rollouts])
            stopped = torch.tensor([float(s.finish_reason == "stop") for s in rnd.rollouts])
            longest = max(longest, float(lengths.max()) if len(lengths) else 0.0)
            domains = rnd.sample_domains
            _add(sums, "groups", float(len(rnd.examples)))
            _add(sums, "groups_informative", float(rnd.informative.sum()))
            for domain in self.stage.domains:
                mine = torch.tensor([d == domain for d in domains], dtype=torch.bool)
                ok = mine & scored
                _add(sums, f"samples/{domain}", float(mine.sum()))
                _add(sums, f"scored/{domain}", float(ok.sum()))
                _add(sums, f"reward_sum/{domain}", float(reward[ok].sum()))
                _add(sums, f"reward_sq_sum/{domain}", float((reward[ok] ** 2).sum()))
                _add(sums, f"raw_reward_sum/{domain}", float(rnd.scores[ok].sum()))
                _add(sums, f"length_sum/{domain}", float(lengths[mine].sum()))
                _add(sums, f"stop_sum/{domain}", float(stopped[mine].sum()))
        return sums, {"response_length_max": longest, "sampling_rounds": float(len(rounds))}

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


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _all_reduce_dict(values: dict[str, float], op, group) -> dict[str, float]:
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(tensor, op=op, group=group)
    return dict(zip(keys, tensor.tolist()))
