"""MOPD: on-policy distillation from a teacher per domain (earlier stages of the run, or folders);
rewards are scored for the logs (and the reward-failure guard), not trained on: a sample whose reward
failed stays in the distillation loss."""

from __future__ import annotations

import dataclasses
import time

import torch

from megatron_cascade.stages.step_batches import rollout_batch
from megatron_cascade.stages.group_filter import GroupRound
from megatron_cascade.stages.teachers import TeacherPool, teacher_logprobs
from megatron_cascade.stages.rollout import RolloutStage
from megatron_cascade.training import TrainBatch
from megatron_cascade.training.step import logprob_pass_options


class MOPDStage(RolloutStage):
    def setup(self) -> None:
        super().setup()
        r = self.runner
        self.teachers = TeacherPool(r.teacher_paths(), r.cfg.model, r.cfg.parallel, r.tok.fingerprint())

    def train_batch(self, chosen: GroupRound, sums: dict, timing: dict) -> TrainBatch:
        r = self.runner
        batch = rollout_batch(chosen.rollouts, r.tok, keep=chosen.keep.flatten(), advantages=None,
                              truncated=r.spec.truncated)
        t0 = time.perf_counter()
        # A teacher is a reference distribution, not the sampler: its log-probs are not truncated.
        spec = dataclasses.replace(r.spec, top_k=0, top_p=1.0)
        batch.teacher_logprobs = teacher_logprobs(self.teachers, batch, chosen.sample_domains, spec,
                                                  **logprob_pass_options(r.stage.training))
        timing["time/teacher_s"] = time.perf_counter() - t0
        sums.update(_reverse_kl_sums(batch, chosen.sample_domains, list(r.stage.domains)))
        return batch


def _reverse_kl_sums(batch: TrainBatch, sample_domains: list[str], domains: list[str]) -> dict[str, float]:
    """Per domain (one teacher each), sums of the sampled-token reverse KL estimate
    log pi_infer(y) - log pi_teacher(y) over loss tokens, and the token counts."""
    per_token = (batch.inference_logprobs - batch.teacher_logprobs) * batch.loss_mask
    per_row, tokens = per_token.sum(dim=1), batch.loss_mask.sum(dim=1)
    sums = {}
    for domain in domains:
        rows = torch.tensor([d == domain for d in sample_domains], dtype=torch.bool)
        sums[f"mopd_rkl_sum/{domain}"] = float(per_row[rows].sum())
        sums[f"mopd_tokens/{domain}"] = float(tokens[rows].sum())
    return sums
