"""A step's scored response groups, and dynamic sampling's choice of which groups to train on.

A generation *round* draws P prompts, samples G responses for each (a group) and scores them. With
``rollout.dynamic_sampling_max_rounds`` > 1 a GRPO step runs further rounds, on further prompts,
until every data-parallel rank holds its share of informative groups (rewards not all equal) or the
round cap is reached (DAPO; NeMo-RL's dynamic sampling). Each rank then trains on exactly its quota
of groups — informative ones first, in generation order, topped up with uninformative ones (masked
out of the loss) when the cap was hit — so every rank runs the same batch shape (the expert-parallel
all-to-alls of an MoE need that).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_cascade.stages.prompt_data import Example
from megatron_cascade.rollout import RolloutBatch


@dataclass
class GroupRound:
    """One round on this rank: ``P`` prompts x ``G`` samples (prompt-major), scored.

    Attributes:
        examples: [P] the prompts' data rows.
        rollouts: the ``generate`` result (P*G samples).
        scores: [P*G] float64 verifier scores (0 where the reward failed).
        errored: [P*G] bool, the reward raised or timed out (the sample is invalid).
        rewards: [P, G] rewards after the overlong policy (what advantages are computed from).
        keep: [P, G] bool, samples the overlong policy keeps in the loss (a stage training on rewards
            also drops those whose reward failed: ``errored``).
        informative: [P] bool, groups whose kept, scored rewards are not all equal.
    """

    examples: list[Example]
    rollouts: RolloutBatch
    scores: torch.Tensor
    errored: torch.Tensor
    rewards: torch.Tensor
    keep: torch.Tensor
    informative: torch.Tensor

    @property
    def sample_domains(self) -> list[str]:
        """[P*G] the domain of each sample."""
        return [self.examples[s.prompt_index].domain for s in self.rollouts]


def select_groups(rounds: list[GroupRound], quota: int, informative_first: bool) -> list[tuple[int, int]]:
    """``(round, group)`` pairs this rank trains on, in generation order.

    Without ``informative_first`` (no dynamic sampling: one round of exactly ``quota`` groups) every
    group. Otherwise the first ``quota`` informative groups, topped up with the earliest uninformative
    groups when fewer were found.
    """
    every = [(r, g) for r, rnd in enumerate(rounds) for g in range(len(rnd.examples))]
    if not informative_first:
        return every[:quota]
    good = [(r, g) for r, g in every if bool(rounds[r].informative[g])]
    rest = [(r, g) for r, g in every if not bool(rounds[r].informative[g])]
    return sorted(good[:quota] + rest[:max(0, quota - len(good))])


def merge_groups(rounds: list[GroupRound], picks: list[tuple[int, int]]) -> GroupRound:
    """The picked groups as one round (prompt indices renumbered in ``picks`` order)."""
    if len(rounds) == 1 and picks == [(0, g) for g in range(len(rounds[0].examples))]:
        return rounds[0]
    G = rounds[0].rewards.shape[1]
    samples = [dataclasses.replace(s, prompt_index=new_index)
               for new_index, (r, g) in enumerate(picks) for s in rounds[r].rollouts.for_prompt(g)]

    def gather(field: str) -> torch.Tensor:
        return torch.stack([getattr(rounds[r], field)[g] for r, g in picks])

    def gather_flat(field: str) -> torch.Tensor:
        return torch.cat([getattr(rounds[r], field)[g * G:(g + 1) * G] for r, g in picks])

    return GroupRound(
        examples=[rounds[r].examples[g] for r, g in picks],
        rollouts=RolloutBatch(samples, rounds[0].rollouts.params),
        scores=gather_flat("scores"), errored=gather_flat("errored"),
        rewards=gather("rewards"), keep=gather("keep"), informative=gather("informative"),
    )
