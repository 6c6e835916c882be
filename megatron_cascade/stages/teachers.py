"""MOPD teachers: frozen copies of earlier checkpoints, one resident at a time, others offloaded.

Each teacher's weights are read once from its weights folder and kept as CPU tensors; one frozen
GPTModel (same architecture as the student) takes the weights of whichever domain is being scored.
A teacher with another vocabulary (tokenizer fingerprint or padded vocab size) is refused.
"""

from __future__ import annotations

import os

import torch

from megatron_cascade.config.model import ConfigError, ModelConfig, ParallelConfig
from megatron_cascade.model import load_model_weights
from megatron_cascade.model.weights_checkpoint import read_model_config
from megatron_cascade.training.batch import TrainBatch
from megatron_cascade.training.loss_plugin import LossSpec
from megatron_cascade.training.policy import build_frozen_model, unwrap
from megatron_cascade.training.step import expert_lockstep_needed, forward_logprobs

TOKENIZER_FINGERPRINT_FILE = "tokenizer_fingerprint.txt"


class VocabularyMismatch(ConfigError):
    """Student and teacher do not share tokenizer and padded vocabulary."""


def check_teacher_vocabulary(weights_dir: str, model_cfg: ModelConfig, tokenizer_fingerprint: str, what: str) -> None:
    """Refuse a teacher whose padded vocab size or tokenizer differs from the student's."""
    arch = read_model_config(weights_dir).get("architecture", {})
    if arch.get("padded_vocab_size") != model_cfg.padded_vocab_size:
        raise VocabularyMismatch(
            f"{what}: teacher {weights_dir} has padded vocab size {arch.get('padded_vocab_size')}, the student "
            f"{model_cfg.padded_vocab_size}: MOPD needs teacher and student to share tokenizer and vocabulary")
    fingerprint_file = os.path.join(weights_dir, TOKENIZER_FINGERPRINT_FILE)
    if os.path.isfile(fingerprint_file):
        with open(fingerprint_file) as f:
            theirs = f.read().strip()
        if theirs != tokenizer_fingerprint:
            raise VocabularyMismatch(
                f"{what}: teacher {weights_dir} was trained with another tokenizer (fingerprint {theirs[:12]}, "
                f"student {tokenizer_fingerprint[:12]}): MOPD scores the student's tokens with the teacher, "
                "so both must share tokenizer and vocabulary")


class TeacherPool:
    """Frozen teachers by domain; ``module_for(domain)`` returns the one model holding its weights."""

    def __init__(self, teachers: dict[str, str], model_cfg: ModelConfig, parallel: ParallelConfig,
                 tokenizer_fingerprint: str) -> None:
        for domain, path in teachers.items():
            check_teacher_vocabulary(path, model_cfg, tokenizer_fingerprint, f"teachers.{domain}")
        self.teachers = dict(teachers)
        self.model_cfg = model_cfg
        # At the policy's precision (bf16: inside Float16Module), so a teacher holding the student's
        # weights computes exactly the student's log-probs.
        self.module = build_frozen_model(model_cfg, parallel)
        gpt = unwrap(self.module)
        # Read every teacher now (a collective load on all ranks), keep CPU copies: later swaps are
        # local, so data-parallel ranks whose batches hold different domains never wait on each other.
        self._offloaded: dict[str, dict[str, torch.Tensor]] = {}
        for path in sorted(set(self.teachers.values())):
            load_model_weights(gpt, path, self.model_cfg)
            self._offloaded[path] = {k: v.detach().to("cpu", copy=True) for k, v in gpt.state_dict().items()
                                     if not k.endswith("_extra_state")}
        self._resident: str | None = None

    def module_for(self, domain: str) -> torch.nn.Module:
        """The frozen model holding ``domain``'s teacher weights (swapped in from the CPU copy)."""
        path = self.teachers[domain]
        if self._resident != path:
            unwrap(self.module).load_state_dict(self._offloaded[path], strict=False)
            self._resident = path
        return self.module


def teacher_logprobs(pool: TeacherPool, batch: TrainBatch, row_domains: list[str], spec: LossSpec,
                     micro_batch_size: int, **packing) -> torch.Tensor:
    """[B, S] float32 log-probs of ``batch.target_ids``, each row under its domain's teacher.

    One forward pass per teacher, over the rows of its domain. When the teachers are MoE models
    whose experts span data-parallel ranks, every rank runs every teacher in the same (sorted)
    order, a rank without rows of a domain running dummy micro-batches (``forward_logprobs``):
    ranks hold different domains, and a pass skipped on one rank would pair the next teacher's
    all-to-all with another teacher's (wrong log-probs) or leave a rank waiting (a hang).
    ``packing``: ``sequence_packing`` / ``max_tokens_per_row`` of ``forward_logprobs``.
    """
    if len(row_domains) != batch.size:
        raise ValueError(f"{len(row_domains)} row domains for a batch of {batch.size} rows")
    missing = sorted(set(row_domains) - set(pool.teachers))
    if missing:
        raise KeyError(f"no teacher for domain(s) {missing}; teachers: {sorted(pool.teachers)}")
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    lockstep = expert_lockstep_needed(pool.module)
    for domain in sorted(pool.teachers):
        rows = torch.tensor([i for i, d in enumerate(row_domains) if d == domain], dtype=torch.long)
        if len(rows) == 0 and not lockstep:
            continue  # no other rank waits on this pass: skip the weight swap too
        out[rows] = forward_logprobs([pool.module_for(domain)], batch.select(rows), spec, micro_batch_size, **packing)
    return out
