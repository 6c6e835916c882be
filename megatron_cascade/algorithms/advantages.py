"""Group-relative advantages for GRPO, dynamic filtering and the overlong-response rule.

Rewards are laid out ``[P, G]``: ``P`` prompts, ``G`` sampled responses per prompt (a group).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_cascade.config.schema import AdvantageBaseline, AdvantageStd, OverlongPolicy

# The config's choice lists (one home for each): the rollout section's keys of the same names.
BASELINES = tuple(AdvantageBaseline.values())
# sample: Bessel-corrected std (n - 1), as verl, NeMo-RL and TRL normalise; population: divide by n.
ADVANTAGE_STDS = tuple(AdvantageStd.values())
OVERLONG_POLICIES = tuple(OverlongPolicy.values())


def _check_rewards(fn: str, rewards: torch.Tensor, valid: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"{fn}: `rewards` must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(
            f"{fn}: `rewards` must have shape [prompts, responses_per_prompt] (2-D), got shape "
            f"{tuple(rewards.shape)}"
        )
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    if valid is None:
        v = torch.ones(r.shape, dtype=torch.bool, device=r.device)
    else:
        if valid.shape != rewards.shape:
            raise ValueError(
                f"{fn}: `valid` has shape {tuple(valid.shape)} but `rewards` has shape "
                f"{tuple(rewards.shape)}; they must match"
            )
        v = valid.bool()
    bad = ~torch.isfinite(r) & v
    if bool(bad.any()):
        p, g = (int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"{fn}: `rewards` has {int(bad.sum())} non-finite value(s); first at [prompt={p}, "
            f"response={g}] = {r[p, g].item()}. Check the reward function for this stage."
        )
    return r, v


def informative_groups(rewards: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dynamic-filtering mask: groups whose rewards are not all equal (std > 0).

    Args:
        rewards: ``[P, G]`` rewards (any real dtype).
        valid: optional ``[P, G]`` bool; only valid responses count (e.g. after
            :func:`apply_overlong_policy` with ``policy="mask"``).

    Returns:
        ``[P]`` bool, True for groups with at least two valid responses whose rewards differ
        (exact comparison, so a group of identical rewards is never kept because of rounding).
    """
    r, v = _check_rewards("informative_groups", rewards, valid)
    return _informative(r, v)


def _informative(r: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    inf = torch.full_like(r, float("inf"))
    hi = torch.where(v, r, -inf).amax(dim=1)
    lo = torch.where(v, r, inf).amin(dim=1)
    return (v.sum(dim=1) >= 2) & (hi > lo)


def group_advantages(
    rewards: torch.Tensor,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    baseline: str = "mean",
    valid: Optional[torch.Tensor] = None,
    std: str = "sample",
) -> torch.Tensor:
    """GRPO group-relative advantages, one scalar per response.

    ``baseline="mean"`` (GRPO): ``A[p, i] = (r[p, i] - mean_p) / (std_p + eps)`` with the group's std:
    the sample std (``n - 1``: verl / NeMo-RL / TRL) or the population std (``n``).

    ``baseline="leave_one_out"`` (RLOO, as NeMo-RL's ``calculate_baseline_and_std_per_prompt``): the
    baseline *and* the std of response ``i`` are those of the other ``m = n - 1`` valid responses of its
    group, ``A[p, i] = (r[p, i] - mean_{-i}) / (std_{-i} + eps)`` (std over ``m - 1`` or ``m``); where
    ``std_{-i}`` is 0 (the others all agree) the advantage is left unnormalised, ``r[p, i] - mean_{-i}``,
    rather than divided by ``eps``.

    Without ``std_normalize`` no division. Groups whose (valid) rewards are all equal get advantage
    exactly 0 (they carry no signal; see :func:`informative_groups` to drop them). Invalid responses
    (``valid`` False) get 0 and do not enter the group statistics.

    Args:
        rewards: ``[P, G]`` rewards (P prompts, G responses each); cast to >= float32.
        std_normalize: divide by ``std + eps``.
        eps: added to the std (reward units).
        baseline: ``"mean"`` or ``"leave_one_out"``.
        valid: optional ``[P, G]`` bool mask of responses that take part (default: all).
        std: ``"sample"`` (default) or ``"population"``.

    Returns:
        ``[P, G]`` advantages (dtype of ``rewards`` promoted to >= float32, no gradient).
    """
    fn = "group_advantages"
    if baseline not in BASELINES:
        raise ValueError(f"{fn}: `baseline` must be one of {BASELINES}, got {baseline!r}")
    if std not in ADVANTAGE_STDS:
        raise ValueError(f"{fn}: `std` must be one of {ADVANTAGE_STDS}, got {std!r}")
    if eps < 0:
        raise ValueError(f"{fn}: `eps` must be >= 0, got {eps}")
    r, v = _check_rewards(fn, rewards, valid)
    zeros = torch.zeros_like(r)
    r = torch.where(v, r, zeros)
    if baseline == "mean":
        adv = _mean_baseline(r, v, std_normalize, eps, std)
    else:
        adv = _leave_one_out(r, v, std_normalize, eps, std)
    keep = _informative(r, v)[:, None] & v
    return torch.where(keep, adv, zeros)


def _mean_baseline(r: torch.Tensor, v: torch.Tensor, std_normalize: bool, eps: float, std: str) -> torch.Tensor:
    n = v.to(r.dtype).sum(dim=1, keepdim=True)
    mean = r.sum(dim=1, keepdim=True) / n.clamp(min=1)
    adv = r - mean
    if not std_normalize:
        return adv
    dev = torch.where(v, adv, torch.zeros_like(r))
    dof = (n - 1 if std == "sample" else n).clamp(min=1)  # groups of one valid response get 0 anyway
    return adv / (torch.sqrt((dev * dev).sum(dim=1, keepdim=True) / dof) + eps)


def _leave_one_out(r: torch.Tensor, v: torch.Tensor, std_normalize: bool, eps: float, std: str) -> torch.Tensor:
    """RLOO baseline and, per response, the std of the other valid responses of its group."""
    vf = v.to(r.dtype)
    m = vf.sum(dim=1, keepdim=True) - vf  # others of each response (valid responses only count)
    others_sum = r.sum(dim=1, keepdim=True) - r
    others_mean = others_sum / m.clamp(min=1)
    adv = r - others_mean
    if not std_normalize:
        return adv
    # Centred second moment of the others (not E[r^2] - E[r]^2: no cancellation, exact zeros).
    dev = r.unsqueeze(1) - others_mean.unsqueeze(2)  # [P, i, j]: r_j - mean_{-i}
    others = v.unsqueeze(1) & ~torch.eye(r.shape[1], dtype=torch.bool, device=r.device).unsqueeze(0)
    ss = torch.where(others, dev * dev, torch.zeros_like(dev)).sum(dim=2)
    dof = m - 1 if std == "sample" else m
    sd = torch.where(dof > 0, torch.sqrt(ss / dof.clamp(min=1)), torch.zeros_like(r))
    return torch.where(sd > 0, adv / (sd + eps), adv)


def apply_overlong_policy(
    rewards: torch.Tensor, finished: torch.Tensor, policy: str = "zero"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Handle responses that did not finish within the response budget.

    Args:
        rewards: rewards of any shape (typically ``[P, G]``).
        finished: bool, same shape; False for responses cut off at the token budget.
        policy: ``"zero"``: unfinished responses get reward 0 (and stay in the loss);
            ``"mask"``: rewards unchanged, unfinished responses are removed from the loss (pass
            the returned mask as ``valid`` to :func:`group_advantages` and expand it to the
            token loss mask).

    Returns:
        ``(rewards, response_mask_keep)``: new rewards (same shape/dtype) and a bool mask of
        responses to keep in the loss (all True for ``"zero"``).
    """
    fn = "apply_overlong_policy"
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"{fn}: `policy` must be one of {OVERLONG_POLICIES}, got {policy!r}")
    if finished.shape != rewards.shape:
        raise ValueError(
            f"{fn}: `finished` has shape {tuple(finished.shape)} but `rewards` has shape "
            f"{tuple(rewards.shape)}; they must match"
        )
    fin = finished.bool()
    if policy == "zero":
        return torch.where(fin, rewards, torch.zeros_like(rewards)), torch.ones_like(fin)
    return rewards.clone(), fin.clone()
