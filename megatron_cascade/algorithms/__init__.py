"""Pure tensor functions of the recipe: advantages, GRPO and MOPD losses, KL, IS weights.

No process groups in here: the distributed backend passes global counts as ``normalizer`` and
all-reduces the summed metrics before :func:`finalize_metrics`.
"""

from ._common import NonFiniteInputError
from .advantages import (
    BASELINES,
    OVERLONG_POLICIES,
    apply_overlong_policy,
    group_advantages,
    informative_groups,
)
from .grpo import GRPO_METRIC_KEYS, grpo_loss
from .importance import IS_MODES, ImportanceWeights, importance_weights
from .kl import KL_ESTIMATORS, k1_kl, k2_kl, k3_kl, kl_penalty
from .metrics import METRIC_MEANS, finalize_metrics
from .mopd import MOPD_METRIC_KEYS, MOPD_NORMALIZATIONS, mopd_loss
from .sft import SFT_METRIC_KEYS, sft_loss

__all__ = [
    "BASELINES",
    "GRPO_METRIC_KEYS",
    "IS_MODES",
    "ImportanceWeights",
    "KL_ESTIMATORS",
    "METRIC_MEANS",
    "MOPD_METRIC_KEYS",
    "MOPD_NORMALIZATIONS",
    "NonFiniteInputError",
    "OVERLONG_POLICIES",
    "apply_overlong_policy",
    "finalize_metrics",
    "group_advantages",
    "grpo_loss",
    "importance_weights",
    "informative_groups",
    "k1_kl",
    "k2_kl",
    "k3_kl",
    "kl_penalty",
    "mopd_loss",
    "SFT_METRIC_KEYS",
    "sft_loss",
]
