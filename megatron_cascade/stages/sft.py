"""SFT: next-token NLL on the domains' reference responses (``sft`` file, else ``train``)."""

from __future__ import annotations

from megatron_cascade.stages.step_batches import sft_batch
from megatron_cascade.stages.base import StageType, StepBatch
from megatron_cascade.training import LossSpec


class SFTStage(StageType):
    needs_response = True
    runs_episodes = False

    def loss_spec(self, vocab_size: int) -> LossSpec:
        return LossSpec(self.entry.loss, self.runner.stage.loss, temperature=1.0, vocab_size=vocab_size)

    @classmethod
    def data_path(cls, domain) -> str:
        return domain.sft or domain.train

    def make_batch(self, step: int, examples) -> StepBatch:
        return StepBatch(sft_batch(examples, self.runner.tok))
