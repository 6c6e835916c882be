"""Shared validation and masking helpers for the loss functions (private).

Everything here is a pure tensor function: no process groups, no global state.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

Number = Union[int, float]
Normalizer = Union[Number, torch.Tensor, None]


class NonFiniteInputError(ValueError):
    """A NaN or +/-inf was found at a valid (mask=1) position of a loss input.

    Subclass of :class:`ValueError`, so callers may catch either.
    """


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the losses compute in: at least float32 (bf16/fp16 inputs are upcast)."""
    return torch.promote_types(dtype, torch.float32)


def check_2d(fn: str, name: str, x: torch.Tensor) -> None:
    """Raise ValueError unless ``x`` is a 2-D tensor ``[B, T]``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(
            f"{fn}: `{name}` must have shape [batch, tokens] (2-D), got shape {tuple(x.shape)}"
        )


def check_same_shape(fn: str, name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise ValueError naming both arguments and shapes unless ``x.shape == ref.shape``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != ref.shape:
        raise ValueError(
            f"{fn}: `{name}` has shape {tuple(x.shape)} but `{ref_name}` has shape "
            f"{tuple(ref.shape)}; they must match"
        )


def as_bool_mask(fn: str, mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a bool tensor; a non-bool mask must hold only 0 and 1.

    A fractional mask (e.g. 0.5) is refused rather than silently binarised.
    """
    if mask.dtype == torch.bool:
        return mask
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        vals = mask[bad].flatten()[:3].tolist()
        raise ValueError(
            f"{fn}: `mask` must be boolean or contain only 0/1, found values such as {vals}"
        )
    return mask != 0


def check_finite_at(fn: str, name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise :class:`NonFiniteInputError` if ``x`` is NaN/inf anywhere ``mask`` is True.

    ``mask`` has the shape of ``x``. Values at masked positions are ignored.
    """
    bad = ~torch.isfinite(x) & mask
    if bool(bad.any()):
        idx = bad.nonzero()
        first = tuple(int(i) for i in idx[0].tolist())
        value = x[first].item()
        where = ", ".join(f"{d}={i}" for d, i in zip(("batch", "token"), first))
        raise NonFiniteInputError(
            f"{fn}: `{name}` has {idx.shape[0]} non-finite value(s) (NaN/inf) at valid "
            f"(mask=1) positions; first at [{where}] = {value}. Values at masked positions "
            f"are ignored, so this is a real numerical problem upstream (model forward, "
            f"inference engine or teacher); pass check_finite=False to skip this check."
        )


def resolve_normalizer(
    fn: str, normalizer: Normalizer, default: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Detached positive normalizer tensor.

    ``None`` -> ``default`` (a local count). A normalizer of 0 (nothing valid anywhere, so the
    numerator is 0 too) is replaced by 1, so an all-masked batch gives loss 0 instead of NaN.
    Negative Python numbers raise ValueError.
    """
    if normalizer is None:
        n = default
    elif isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise ValueError(
                f"{fn}: `normalizer` must be a scalar, got shape {tuple(normalizer.shape)}"
            )
        n = normalizer.detach().reshape(())
    else:
        if not isinstance(normalizer, (int, float)) or isinstance(normalizer, bool):
            raise TypeError(f"{fn}: `normalizer` must be a number or scalar tensor, got {normalizer!r}")
        if normalizer < 0:
            raise ValueError(f"{fn}: `normalizer` must be >= 0, got {normalizer}")
        n = torch.tensor(float(normalizer), device=default.device)
    n = n.to(device=default.device, dtype=dtype)
    return torch.where(n > 0, n, torch.ones_like(n))


def check_bounds(fn: str, name: str, bounds: tuple[float, float]) -> tuple[float, float]:
    """Validate a ``(low, high)`` pair with ``0 <= low <= high``."""
    try:
        lo, hi = (float(b) for b in bounds)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: `{name}` must be a pair (low, high), got {bounds!r}") from None
    if not (0.0 <= lo <= hi):
        raise ValueError(f"{fn}: `{name}` must satisfy 0 <= low <= high, got {bounds!r}")
    return lo, hi


def f64_sum(x: torch.Tensor) -> torch.Tensor:
    """Detached float64 sum (exact for token counts; all-reduce friendly)."""
    return x.detach().sum(dtype=torch.float64)


def optional_check(
    fn: str, name: str, x: Optional[torch.Tensor], ref: torch.Tensor
) -> Optional[torch.Tensor]:
    if x is None:
        return None
    check_same_shape(fn, name, x, "logprobs", ref)
    return x
