"""The per-type part of a cascade stage, and what it hands the runner each step.

``cascade/stage.py`` (``StageRunner``) owns what every stage does the same way: the policy and its
start weights, resume, the prompt mixer, the step loop, checkpoints, logging, final weights and
evaluation. A ``StageType`` says where its data comes from, what it optimises, what it builds
once (reference models, teachers, rewards) and how a step's batch is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from megatron_cascade.config.stage_types import StageTypeEntry, stage_type

if TYPE_CHECKING:
    from megatron_cascade.config.schema import DomainConfig, ResolvedStage, RunConfig
    from megatron_cascade.rollout.replica_groups import GenerationReplica
    from megatron_cascade.stages.prompt_data import Example
    from megatron_cascade.tokenizers.base import Tokenizer
    from megatron_cascade.training import LossSpec, Policy, TrainBatch


class StageRunnerView(Protocol):
    """What a stage type reads of the runner that drives it (``cascade/stage.py``'s ``StageRunner``,
    which sits above this package: stages never import it)."""

    stage: "ResolvedStage"
    cfg: "RunConfig"
    tok: "Tokenizer"
    spec: "LossSpec"  # the stage's loss (``StageType.loss_spec``)
    index: int  # the stage's position in the cascade
    dp_rank: int
    dp_group: object  # the data-parallel process group
    policy: "Policy"

    def teacher_paths(self) -> dict[str, str]:
        """MOPD: each domain's teacher weights folder."""

    def my_share(self, step: int, round: int = 0) -> list["Example"]:
        """This data-parallel rank's prompts of ``step`` (dynamic sampling: of its ``round``)."""

    def generation_replica(self) -> "GenerationReplica":
        """The model that generates this step (the policy, or its decode copy refit to this step's weights)."""

    def generation_done(self) -> None:
        """Generation of this step has ended (a decode copy releases its memory)."""


@dataclass
class StepBatch:
    """One step's training batch on this rank and what the runner logs about it.

    Attributes:
        batch: the rank's share of the global batch.
        sums: metric sums, all-reduced (SUM) over data-parallel ranks by the runner.
        maxes: metric maxima, all-reduced (MAX).
        timing: seconds spent per phase on this rank (``time/*``).
    """

    batch: "TrainBatch"
    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)


class StageType:
    """Base class of a stage type (register it in ``stages/registry.py``).

    Attributes:
        needs_response: its data rows must carry a reference ``response`` (SFT).
        runs_episodes: its rows start episodes in their domain's environment (every stage that
            generates), so the environment checks them when the data loads (``Environment.check_row``).
    """

    needs_response: ClassVar[bool] = False
    runs_episodes: ClassVar[bool] = True

    def __init__(self, runner: StageRunnerView) -> None:
        self.runner = runner
        self.entry: StageTypeEntry = stage_type(runner.stage.type)

    def loss_spec(self, vocab_size: int) -> "LossSpec":
        """What the stage optimises (default: the registered loss on the log-probs of the distribution
        the rollouts were sampled from: temperature, top-k, top-p of ``rollout``)."""
        from megatron_cascade.stages.sampling_spec import rollout_loss_spec

        return rollout_loss_spec(self.runner.stage, self.entry.loss, vocab_size)

    def data_file(self, domain: str) -> str:
        """The JSONL file this stage draws ``domain``'s rows from (``data_path``)."""
        return self.data_path(self.runner.cfg.domains[domain])

    @classmethod
    def data_path(cls, domain: "DomainConfig") -> str:
        """The JSONL file a stage of this type reads for ``domain`` (default: its ``train``); also what
        a run checks before its first step (``cascade/preflight.py``)."""
        return domain.train

    def setup(self) -> None:
        """Build what the stage needs besides the policy. Called once the policy holds the stage's start
        weights and before a resume loads a checkpoint over them (a KL reference is the stage start)."""

    def make_batch(self, step: int, examples: list["Example"]) -> StepBatch:
        """The batch of ``step`` from this rank's ``examples`` (collective where the type needs it)."""
        raise NotImplementedError

    def step_done(self, metrics: dict[str, float]) -> None:
        """See the step's metrics (reduced over ranks: the same on every rank) before the next step."""
