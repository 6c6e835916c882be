"""Schema of the ``optimizer``, ``loss`` and ``training`` config sections (their single home of defaults).

Each field carries its valid values (a ``Choice`` enum or a ``ranged`` rule); ``validate`` methods
hold the rules between fields of a section, ``validate_optimizer_config`` the one with the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.config.rules import Choice, ConfigError, ranged, require, validate_tree


class LrDecayStyle(Choice):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class ImportanceCorrection(Choice):
    icepop = "icepop"  # weight 0 outside [is_low, is_high] (ICE-POP)
    truncate = "truncate"  # weight min(ratio, is_high)
    none = "none"


class MopdNormalization(Choice):
    sequence = "sequence"
    token = "token"


_LOSS_SCALE_KEYS = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


@dataclass
class OptimizerConfig:
    """AdamW with warmup and decay; a fresh one is built at the start of every stage."""

    lr: float = ranged(3e-6, ge=0)
    min_lr: float = ranged(0.0, ge=0)  # <= lr
    weight_decay: float = ranged(0.0, ge=0)
    adam_beta1: float = ranged(0.9, ge=0, lt=1)
    adam_beta2: float = ranged(0.95, ge=0, lt=1)
    adam_eps: float = ranged(1e-8, gt=0)
    clip_grad: float = ranged(1.0, ge=0)  # max global grad norm; 0 = no clipping
    lr_warmup_steps: int = ranged(0, ge=0)
    lr_warmup_init: float = ranged(0.0, ge=0)  # lr at step 0 of the warmup (MOPD: 2e-7 -> 2e-6 over 30 steps)
    lr_decay_style: LrDecayStyle = LrDecayStyle.constant
    lr_decay_steps: Optional[int] = ranged(None, ge=1)  # null = the stage's number of steps
    # fp16 loss scaling (model.precision=fp16 only): the loss is multiplied by the scale before the
    # backward pass so small gradients survive fp16; a step whose gradients overflow is skipped and
    # the scale halved (after `hysteresis` overflows); it doubles after `loss_scale_window` clean steps.
    loss_scale: Optional[float] = ranged(None, gt=0, why="or null for a dynamic scale")  # a fixed scale
    initial_loss_scale: float = ranged(65536.0, gt=0)  # 2^16: each skipped step wastes a whole rollout batch in RL
    min_loss_scale: float = ranged(1.0, gt=0)  # <= initial_loss_scale
    loss_scale_window: int = ranged(1000, ge=1)
    hysteresis: int = ranged(2, ge=1)

    def validate(self, prefix: str = "optimizer.") -> None:
        """Rules between the optimizer fields (``ConfigError`` naming the keys)."""
        require(self.min_lr <= self.lr, f"{prefix}min_lr={self.min_lr} must be in [0, {prefix}lr={self.lr}]")
        require(self.lr_warmup_init <= self.lr,
                f"{prefix}lr_warmup_init={self.lr_warmup_init} must be in [0, {prefix}lr={self.lr}]")
        require(self.min_loss_scale <= self.initial_loss_scale, f"{prefix}min_loss_scale={self.min_loss_scale} "
                f"must be in (0, {prefix}initial_loss_scale={self.initial_loss_scale}]")


def validate_optimizer_config(optim: OptimizerConfig, model_cfg: ModelConfig | None = None,
                              prefix: str = "optimizer.") -> None:
    """Raise ``ConfigError`` naming the key for impossible optimizer settings.

    With ``model_cfg``, also refuse fp16 loss-scale settings on a model that is not fp16 (they
    would do nothing).
    """
    validate_tree(optim, prefix)
    if model_cfg is None or model_cfg.precision == "fp16":
        return
    defaults = {f.name: f.default for f in fields(OptimizerConfig)}
    changed = [k for k in _LOSS_SCALE_KEYS if getattr(optim, k) != defaults[k]]
    if changed:
        raise ConfigError(f"{prefix}{changed[0]} sets fp16 loss scaling, but model.precision="
                          f"{model_cfg.precision!r}: loss scaling applies to model.precision=fp16 only")


@dataclass
class LossConfig:
    """GRPO / MOPD loss settings (see algorithms/grpo.py and algorithms/mopd.py)."""

    # PPO ratio clip [1 - clip_eps_low, 1 + clip_eps_high]; 0 would pin the ratio to 1 after the first epoch.
    clip_eps_low: float = ranged(0.2, gt=0, lt=1, why="1 - clip_eps_low is the ratio's lower clip, > 0")
    clip_eps_high: float = ranged(0.2, gt=0)
    importance_correction: ImportanceCorrection = ImportanceCorrection.icepop
    # Bounds of pi_train / pi_infer, around 1 (is_low <= 1 <= is_high: on-policy tokens are kept).
    is_low: float = ranged(0.5, ge=0, le=1)
    is_high: float = ranged(2.0, ge=1)
    kl_coef: float = ranged(0.0, ge=0)  # k3 KL to the stage's starting weights (RLHF: 0.03)
    mopd_normalization: MopdNormalization = MopdNormalization.sequence


@dataclass
class TrainingConfig:
    """How one rollout batch is turned into optimizer steps."""

    micro_batch_size: int = ranged(4, ge=1)  # sequences per micro-batch per data-parallel rank
    ppo_epochs: int = ranged(1, ge=1)  # 1 = strictly on-policy (one optimizer step per rollout batch)
    skip_nonfinite_steps: bool = True  # skip (and log) a step whose gradients hold NaN/inf
    # Padding-free packing (training/packing.py): training, old-policy, teacher and reference passes pack
    # the batch's sequences (each up to its last loss token) into rows of max_tokens_per_row tokens (THD),
    # one row per micro-batch; losses and the global normaliser are those of the unpacked batch.
    # Context parallelism (parallel.context_parallel_size > 1) packs whatever this says (the default budget
    # unless sequence_packing sets one).
    sequence_packing: bool = False
    # Token budget of a packed row (a longer sequence gets a row of its own); null = micro_batch_size x
    # the batch's longest sequence (what a padded micro-batch holds). Only with sequence_packing.
    max_tokens_per_row: Optional[int] = ranged(None, ge=1)

    def validate(self, prefix: str = "training.") -> None:
        """Rules between the training fields (``ConfigError`` naming the keys)."""
        require(self.max_tokens_per_row is None or self.sequence_packing,
                f"{prefix}max_tokens_per_row={self.max_tokens_per_row} does nothing without "
                f"{prefix}sequence_packing=true: set it, or max_tokens_per_row to null")
