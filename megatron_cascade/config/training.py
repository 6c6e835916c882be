"""Schema of the ``optimizer``, ``loss`` and ``training`` config sections (their single home of defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class OptimizerConfig:
    """AdamW with warmup and decay; a fresh one is built at the start of every stage."""

    lr: float = 3e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; 0 = no clipping
    lr_warmup_steps: int = 0
    lr_warmup_init: float = 0.0  # lr at step 0 of the warmup (MOPD: 2e-7 -> 2e-6 over 30 steps)
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_decay_steps: Optional[int] = None  # null = the stage's number of steps
    # fp16 loss scaling (model.precision=fp16 only): the loss is multiplied by the scale before the
    # backward pass so small gradients survive fp16; a step whose gradients overflow is skipped and
    # the scale halved (after `hysteresis` overflows); it doubles after `loss_scale_window` clean steps.
    loss_scale: Optional[float] = None  # a fixed scale; null = dynamic
    initial_loss_scale: float = 65536.0  # 2^16: each skipped step wastes a whole rollout batch in RL
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class LossConfig:
    """GRPO / MOPD loss settings (see algorithms/grpo.py and algorithms/mopd.py)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    importance_correction: str = "icepop"  # icepop (weight 0 outside bounds) | truncate | none
    is_low: float = 0.5  # bounds of pi_train / pi_infer
    is_high: float = 2.0
    kl_coef: float = 0.0  # k3 KL to the stage's starting weights (RLHF: 0.03)
    mopd_normalization: str = "sequence"  # sequence | token


@dataclass
class TrainingConfig:
    """How one rollout batch is turned into optimizer steps."""

    micro_batch_size: int = 4  # sequences per micro-batch per data-parallel rank
    ppo_epochs: int = 1  # 1 = strictly on-policy (one optimizer step per rollout batch)
    skip_nonfinite_steps: bool = True  # skip (and log) a step whose gradients hold NaN/inf
