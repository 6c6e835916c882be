"""Left padding that Mamba layers do not see: padding positions feed nothing into the conv or SSM state.

The static generation batch left-pads prompts of different lengths (``layout.py``); attention masks
the padding, but a Mamba layer has no mask: every position it is given enters its causal conv and
its recurrence, so a padded row would start from a state built from padding tokens. What a
position feeds into them is its slice of the mixer's input projection ``[z | x B C | dt]``: with
``xBC = 0`` the conv sees a zero input (what it sees before a sequence starts) and with ``dt`` very
negative, ``softplus(dt + dt_bias) = 0``, so the SSM step is ``S = exp(0 * A) S + 0 * x B = S``: the
state passes through unchanged (zero, as padding comes first). A forward hook on each mixer's
``in_proj`` writes those values at the padding positions of the forward running now; the real
tokens then compute exactly what they compute unpadded (float rounding aside). Outputs at padding
positions are meaningless and never read (attention masks them; no logits are sampled there).
"""

from __future__ import annotations

from typing import Optional

import torch

# softplus(-1e4 + dt_bias) underflows to exactly 0 in fp32/bf16/fp16 (fp16 holds -1e4).
_NO_STEP = -1.0e4


class MambaPaddingMask:
    """Hooks on every Mamba mixer of ``model`` (this rank's stage); ``set(mask)`` before a forward.

    ``mask``: bool ``[B, s]``, True at padding positions of the forward's ``s`` columns; None = no padding.
    Call ``remove()`` when the batch is done.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.ssm.mamba_mixer import MambaMixer

        self.mask: Optional[torch.Tensor] = None
        self._handles = [m.in_proj.register_forward_hook(self._hook(m)) for m in model.modules()
                         if isinstance(m, MambaMixer)]

    def set(self, mask: Optional[torch.Tensor]) -> None:
        """The padding of the next forward (None or all-False: nothing is changed)."""
        self.mask = mask if mask is not None and bool(mask.any()) else None

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, mixer):
        # This TP rank's columns of the input projection: [z | x B C | dt] (each part split over TP).
        xbc = mixer.d_inner_local_tp + 2 * mixer.ngroups_local_tp * mixer.d_state
        sizes = [mixer.d_inner_local_tp, xbc, mixer.nheads_local_tp]

        def hook(module, inputs, output):
            if self.mask is None:
                return output
            out, bias = output
            pad = self.mask.t().unsqueeze(-1)  # [s, B, 1], the projection is [s, B, width]
            if pad.shape[0] != out.shape[0]:
                raise RuntimeError(f"Mamba padding mask covers {pad.shape[0]} positions, the forward {out.shape[0]}")
            z, x_bc, dt = out.split(sizes, dim=-1)
            out = torch.cat([z, x_bc.masked_fill(pad, 0.0), dt.masked_fill(pad, _NO_STEP)], dim=-1)
            return out, bias

        return hook
