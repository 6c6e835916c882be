"""GRPO: group-relative advantages from the rewards of G responses per prompt, uninformative groups
filtered (and refilled by dynamic sampling), optional k3 KL to the stage's start weights."""

from __future__ import annotations

import time

from megatron_cascade.algorithms import group_advantages
from megatron_cascade.stages.step_batches import rollout_batch
from megatron_cascade.stages.group_filter import GroupRound
from megatron_cascade.stages.rollout import RolloutStage
from megatron_cascade.training import TrainBatch, forward_logprobs
from megatron_cascade.training.policy import build_frozen_model
from megatron_cascade.training.step import logprob_pass_options


class GRPOStage(RolloutStage):
    def setup(self) -> None:
        super().setup()
        self.reference = self._reference_model()

    def _reference_model(self):
        """Frozen stage-start weights for the KL term (only when loss.kl_coef > 0)."""
        r = self.runner
        if not self.entry.kl_reference or r.stage.loss.kl_coef == 0:
            return None
        model = build_frozen_model(r.cfg.model, r.cfg.parallel)
        model.load_state_dict(r.policy.module.state_dict())
        return model

    def train_batch(self, chosen: GroupRound, sums: dict, timing: dict) -> TrainBatch:
        r = self.runner
        ro = r.stage.rollout
        # A failed reward's 0 is not a verdict on the response: the sample leaves the loss, the
        # normaliser and its group's advantage statistics.
        keep = chosen.keep & ~chosen.errored.view_as(chosen.keep)
        advantages = group_advantages(chosen.rewards, std_normalize=ro.std_normalize_advantages,
                                      baseline=ro.advantage_baseline, std=ro.advantage_std, valid=keep)
        if ro.filter_uninformative_groups:
            keep = keep & chosen.informative.unsqueeze(1)
        sums["groups_trained"] = float(chosen.informative.sum())
        sums["advantage_abs_sum"] = float((advantages.abs() * keep).sum())
        sums["samples_trained"] = float(keep.sum())
        batch = rollout_batch(chosen.rollouts, r.tok, keep=keep.flatten(), advantages=advantages.flatten().float(),
                              truncated=r.spec.truncated)
        if self.reference is not None:
            t0 = time.perf_counter()
            batch.ref_logprobs = forward_logprobs([self.reference], batch, r.spec,
                                                  **logprob_pass_options(r.stage.training))
            timing["time/reference_s"] = time.perf_counter() - t0
        return batch
