"""Megatron-Core training backend: loss plug-in, policy (DDP + optimizer), train step."""

from megatron_cascade.training.batch import TrainBatch
from megatron_cascade.training.loss_plugin import LossSpec, make_forward_step
from megatron_cascade.training.losses import LOSSES
from megatron_cascade.training.policy import Policy, build_policy
from megatron_cascade.training.step import forward_logprobs, optimize_on_batch, train_step

__all__ = [
    "TrainBatch", "LOSSES", "LossSpec", "make_forward_step", "Policy", "build_policy",
    "forward_logprobs", "optimize_on_batch", "train_step",
]
