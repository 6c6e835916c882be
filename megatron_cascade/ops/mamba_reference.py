"""Pure-torch Mamba-2 kernels: the SSD chunked scan and the causal depthwise conv, for CPU.

Megatron-Core's ``MambaMixer`` calls ``mamba_ssm``'s Triton kernels (``mamba_chunk_scan_combined``,
``mamba_split_conv1d_scan_combined``) and ``causal_conv1d``; neither package builds without CUDA.
These functions take the same arguments and return the same values (up to float rounding), with
autograd for the backward pass. CPU mode (``cpu_runtime.py``) installs them into ``mamba_mixer``.

The recurrence (per batch row, head h, head channel p, state n; ``dt`` after bias and softplus)::

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t[p] * B_t[n]      (S_{-1} = initial state, or 0)
    y_t[p] = sum_n C_t[n] * S_t[p, n] + D_h * x_t[p]

``seq_idx`` (packed sequences) restarts the state at 0 wherever the sequence index changes.
It is computed in chunks of ``chunk_size`` tokens (Mamba-2's "SSD" form): within a chunk as a
masked decay-weighted attention-like product, across chunks by carrying the state; the chunk size
changes the float rounding only.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _expand_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """[b, l, g, n] -> [b, l, h, n]: head i reads group i // (h / g)."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def _discretize_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor], dt_softplus: bool,
                   dt_limit: tuple[float, float]) -> torch.Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _zero_outside(t: torch.Tensor, seq_idx: torch.Tensor) -> torch.Tensor:
    """``t`` [b, l, ...] with the rows of no sequence (``seq_idx`` [b, l] < 0) set to 0."""
    outside = (seq_idx < 0).view(*seq_idx.shape, *([1] * (t.dim() - 2)))
    return torch.where(outside, torch.zeros((), dtype=t.dtype, device=t.device), t)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk_size: int, *, initial_states: Optional[torch.Tensor] = None,
             seq_idx: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan in float32, chunked; ``dt`` already discretised (bias, softplus, limits).

    Args:
        x: [b, l, h, p]; dt: [b, l, h]; A: [h] (negative decay rates); B, C: [b, l, h, n]
            (groups already expanded to heads); initial_states: [b, h, p, n] or None;
            seq_idx: [b, l] int, non-decreasing along l, or None.

    Returns:
        y without the D skip: [b, l, h, p] (float32); final state [b, h, p, n] (float32).
    """
    b, l, h, p = x.shape
    n = B.shape[-1]
    q = chunk_size
    pad = (-l) % q
    x, dt, B, C = (t.float() for t in (x, dt, B, C))
    if seq_idx is None:
        seq_idx = torch.zeros(b, l, dtype=torch.int64, device=x.device)
    seq_idx = seq_idx.long()
    # seq_idx < 0: rows of no sequence (Megatron's inference scratch rows, uninitialised, possibly
    # NaN): zeroed with where, as the kernels' masked loads do, since masks multiply (NaN * 0 = NaN).
    x, dt, B, C = (_zero_outside(t, seq_idx) for t in (x, dt, B, C))
    if pad:
        # Padding tokens have dt = 0 (no decay, no input) and the last sequence's index.
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
        seq_idx = torch.cat([seq_idx, seq_idx[:, -1:].expand(b, pad)], dim=1)
    c = (l + pad) // q
    x, B, C = (t.reshape(b, c, q, h, -1) for t in (x, B, C))
    dt = dt.reshape(b, c, q, h)
    seq = seq_idx.reshape(b, c, q)
    a_cum = torch.cumsum(dt * A.float(), dim=2)  # [b, c, q, h], log decay from the chunk start

    # Within a chunk: y_t += sum_{s <= t, same sequence} exp(a_t - a_s) (C_t . B_s) dt_s x_s.
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    same = (seq.unsqueeze(-1) == seq.unsqueeze(-2)) & causal  # [b, c, t, s]
    seg = a_cum.unsqueeze(3) - a_cum.unsqueeze(2)  # [b, c, t, s, h]
    decay = torch.exp(seg.masked_fill(~same.unsqueeze(-1), float("-inf")))
    scores = torch.einsum("bcthn,bcshn->bctsh", C, B) * decay * dt.unsqueeze(2)
    y = torch.einsum("bctsh,bcshp->bcthp", scores, x)

    # Each chunk's own contribution to the state at its last token (tokens of its last sequence).
    last_seq = seq[:, :, -1:]
    to_end = torch.exp(a_cum[:, :, -1:, :] - a_cum).masked_fill((seq != last_seq).unsqueeze(-1), 0.0)
    chunk_states = torch.einsum("bcsh,bcshp,bcshn->bchpn", to_end * dt, x, B)

    # Across chunks: carry the state; it reaches only the tokens of the sequence it belongs to.
    state = x.new_zeros(b, h, p, n) if initial_states is None else initial_states.float()
    state_seq = seq[:, 0, 0]  # the initial state belongs to the first sequence
    ys = []
    for k in range(c):
        reach = (seq[:, k] == state_seq.unsqueeze(-1)).float()  # [b, q]
        ys.append(torch.einsum("bthn,bhpn,bth->bthp", C[:, k], state, torch.exp(a_cum[:, k]) * reach.unsqueeze(-1)))
        keep = (seq[:, k, -1] == state_seq).float().view(b, 1, 1, 1)
        state = keep * torch.exp(a_cum[:, k, -1]).view(b, h, 1, 1) * state + chunk_states[:, k]
        state_seq = seq[:, k, -1]
    y = y + torch.stack(ys, dim=1)
    return y.reshape(b, c * q, h, p)[:, :l], state


def mamba_chunk_scan_combined(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                              C: torch.Tensor, chunk_size: int, D: Optional[torch.Tensor] = None,
                              z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                              initial_states: Optional[torch.Tensor] = None,
                              seq_idx: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                              dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                              return_final_states: bool = False, return_varlen_states: bool = False):
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` in torch.

    Args:
        x: [b, l, h, p]; dt: [b, l, h] (raw: ``dt_bias`` / softplus / ``dt_limit`` applied here);
        A: [h]; B, C: [b, l, g, n]; D: [h] or [h, p]; z: [b, l, h, p] gate (``y * silu(z)``);
        initial_states: [b, h, p, n]; seq_idx: [b, l]; cu_seqlens: [num_seqs + 1] token offsets
        (with ``return_varlen_states``, batch size 1).

    Returns:
        y [b, l, h, p] in x's dtype; then the final state [b, h, p, n] if ``return_final_states``
        (float32), then each sequence's final state [num_seqs, h, p, n] if ``return_varlen_states``.
    """
    h = x.shape[2]
    dt_d = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch = _expand_groups(B, h), _expand_groups(C, h)
    y, final = ssd_scan(x, dt_d, A, Bh, Ch, chunk_size, initial_states=initial_states, seq_idx=seq_idx)
    if D is not None:
        y = y + x.float() * (D.float().view(1, 1, h, -1))
    if z is not None:
        y = y * F.silu(z.float())
    outs = [y.to(x.dtype)]
    if return_final_states:
        outs.append(final)
    if return_varlen_states:
        if cu_seqlens is None or x.shape[0] != 1:
            raise ValueError("return_varlen_states needs cu_seqlens and batch size 1")
        outs.append(_varlen_states(x, dt_d, A, Bh, Ch, chunk_size, cu_seqlens, initial_states))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _varlen_states(x, dt, A, B, C, chunk_size, cu_seqlens, initial_states) -> torch.Tensor:
    """Each packed sequence's final state, [num_seqs, h, p, n] (one scan per sequence)."""
    states = []
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_states is None else initial_states[i:i + 1]
        _, state = ssd_scan(x[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end], chunk_size,
                            initial_states=init)
        states.append(state)
    return torch.cat(states, dim=0)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                  seq_idx: Optional[torch.Tensor] = None, initial_states: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None) -> torch.Tensor:
    """``causal_conv1d.causal_conv1d_fn`` in torch: a depthwise causal convolution.

    ``out[:, d, t] = bias[d] + sum_k weight[d, k] * x[:, d, t - (w-1) + k]`` over taps inside the
    same sequence as ``t`` (``seq_idx``), earlier taps from ``initial_states`` ([b, d, w-1]) or 0.

    Args:
        x: [b, d, l]; weight: [d, w]; bias: [d]; seq_idx: [b, l]; activation: None | silu | swish.

    Returns:
        [b, d, l], x's dtype.
    """
    b, d, l = x.shape
    w = weight.shape[-1]
    if seq_idx is not None:  # rows of no sequence (< 0) may hold anything: zeroed (see ssd_scan)
        x = _zero_outside(x.transpose(1, 2), seq_idx).transpose(1, 2)
    history = x.new_zeros(b, d, w - 1) if initial_states is None else initial_states.to(x.dtype)
    padded = torch.cat([history, x], dim=-1)
    windows = padded.unfold(-1, w, 1)  # [b, d, l, w]: taps t-(w-1) .. t
    if seq_idx is not None:
        idx = F.pad(seq_idx.long(), (w - 1, 0), value=-1)  # history taps: no sequence (masked)
        if initial_states is not None:
            idx[:, : w - 1] = seq_idx[:, :1].long()  # ... unless given: they continue the first one
        same = idx.unfold(-1, w, 1) == seq_idx.long().unsqueeze(-1)  # [b, l, w]
        windows = torch.where(same.unsqueeze(1), windows, torch.zeros((), dtype=windows.dtype, device=x.device))
    out = (windows * weight.unsqueeze(1)).sum(-1)
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation {activation!r} is not supported (None, silu or swish)")
    return out


def mamba_split_conv1d_scan_combined(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor,
                                     conv1d_bias: Optional[torch.Tensor], dt_bias: torch.Tensor, A: torch.Tensor,
                                     D: torch.Tensor, chunk_size: int, initial_states: Optional[torch.Tensor] = None,
                                     seq_idx: Optional[torch.Tensor] = None,
                                     dt_limit: tuple[float, float] = (0.0, float("inf")),
                                     return_final_states: bool = False, activation: str = "silu",
                                     rmsnorm_weight: Optional[torch.Tensor] = None, rmsnorm_eps: float = 1e-6,
                                     outproj_weight: Optional[torch.Tensor] = None,
                                     outproj_bias: Optional[torch.Tensor] = None, headdim: Optional[int] = None,
                                     ngroups: int = 1, norm_before_gate: bool = True) -> torch.Tensor:
    """``mamba_ssm``'s fused training path in torch: split [z | xBC | dt], causal conv + silu on xBC,
    SSD scan, gate ``y * silu(z)``; Megatron's training path (no norm / out-projection fused).

    Args:
        zxbcdt: [b, l, 2*h*p + 2*g*n + h]; conv1d_weight: [h*p + 2*g*n, w]; D: [h] (with
            ``headdim``) or [h, p].

    Returns:
        [b, l, h*p], zxbcdt's dtype (and the final state if ``return_final_states``).
    """
    if rmsnorm_weight is not None or outproj_weight is not None:
        raise NotImplementedError("the torch reference does not fuse the gated norm or the out projection "
                                  "(Megatron-Core applies them outside the kernel)")
    nheads, headdim = (D.shape[0], headdim) if D.dim() == 1 else D.shape
    b, l, _ = zxbcdt.shape
    dim = nheads * headdim
    dstate = (zxbcdt.shape[-1] - 2 * dim - nheads) // ngroups // 2
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xbc = causal_conv1d(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                        activation=activation).transpose(1, 2)
    x, B, C = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    out = mamba_chunk_scan_combined(
        x.reshape(b, l, nheads, headdim), dt, A, B.reshape(b, l, ngroups, dstate), C.reshape(b, l, ngroups, dstate),
        chunk_size, D=D, z=z.reshape(b, l, nheads, headdim), dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit, return_final_states=return_final_states)
    if return_final_states:
        y, final = out
        return y.reshape(b, l, dim), final
    return out.reshape(b, l, dim)


def causal_conv1d_varlen_states(x: torch.Tensor, cu_seqlens: torch.Tensor, state_len: int) -> torch.Tensor:
    """``causal_conv1d.causal_conv1d_varlen.causal_conv1d_varlen_states`` in torch: each packed
    sequence's conv state after its prefill, its last ``state_len`` inputs (zeros before its start).

    Args:
        x: [total_tokens, d] packed inputs; cu_seqlens: [num_seqs + 1] token offsets.

    Returns:
        [num_seqs, d, state_len], x's dtype.
    """
    bounds = cu_seqlens.tolist()
    out = x.new_zeros(len(bounds) - 1, x.shape[1], state_len)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        n = min(state_len, end - start)
        if n > 0:
            out[i, :, state_len - n:] = x[end - n:end].transpose(0, 1)
    return out


def _state_rows(state: torch.Tensor, batch: int, indices: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows of a per-request state buffer [N, ...] that a decode step of ``batch`` rows updates
    (``indices`` [batch], -1 = a padding row that updates nothing; None = rows 0..batch-1)."""
    if indices is None:
        return torch.arange(batch, device=state.device)
    return indices.long()


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                         conv_state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``causal_conv1d.causal_conv1d_update`` in torch: one decode step of the depthwise conv.

    The state window shifts left by one and takes ``x`` as its newest column (in place, in the
    rows ``conv_state_indices`` name); the output is the window times the weight.

    Args:
        x: [b, d]; conv_state: [N, d, w] (N >= b; updated in place); weight: [d, w]; bias: [d];
        conv_state_indices: [b] state row of each batch row (-1: padding, left alone).

    Returns:
        [b, d], x's dtype.
    """
    rows = _state_rows(conv_state, x.shape[0], conv_state_indices)
    real = rows >= 0
    window = torch.cat([conv_state[rows.clamp(min=0), :, 1:], x.unsqueeze(-1).to(conv_state.dtype)], dim=-1)
    conv_state[rows[real]] = window[real]
    out = (window * weight.unsqueeze(0)).sum(-1)
    if bias is not None:
        out = out + bias
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation {activation!r} is not supported (None, silu or swish)")
    return out.to(x.dtype)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor] = None,
                           z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                           dt_softplus: bool = False,
                           state_batch_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``mamba_ssm.ops.triton.selective_state_update.selective_state_update`` in torch: one token
    of the recurrence above, for every batch row, in float32.

    Args:
        state: [N, h, p, n] (updated in place in the rows ``state_batch_indices`` name, -1 = padding);
        x, dt: [b, h, p]; A: [h, p, n]; B, C: [b, g, n] (g groups shared by h / g heads each);
        D, dt_bias: [h, p]; z: [b, h, p] gate (``y * silu(z)``).

    Returns:
        y [b, h, p] in x's dtype.
    """
    rows = _state_rows(state, x.shape[0], state_batch_indices)
    real = rows >= 0
    h = x.shape[1]
    dt = _discretize_dt(dt, dt_bias, dt_softplus, (0.0, float("inf")))
    Bh = _expand_groups(B.unsqueeze(1), h).squeeze(1).float()  # [b, h, n]
    Ch = _expand_groups(C.unsqueeze(1), h).squeeze(1).float()
    prev = state[rows.clamp(min=0)].float()
    new = torch.exp(dt.unsqueeze(-1) * A.float()) * prev + (dt * x.float()).unsqueeze(-1) * Bh.unsqueeze(2)
    state[rows[real]] = new[real].to(state.dtype)
    y = (new * Ch.unsqueeze(2)).sum(-1)
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


class GatedRMSNorm(torch.nn.Module):
    """``mamba_ssm``'s ``RMSNormGated`` (norm_before_gate=False) in torch: ``rmsnorm(x * silu(z)) * weight``,
    the RMS taken over groups of ``group_size`` channels (Mamba-2 normalises each B/C group alone).

    Shapes: x, z [..., hidden_size]; the weight is [hidden_size].
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: Optional[int] = None,
                 norm_before_gate: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        if norm_before_gate:
            raise NotImplementedError("norm_before_gate=True (Megatron-Core's MambaMixer asserts False)")
        self.eps = eps
        self.group_size = group_size or hidden_size
        if hidden_size % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide hidden_size {hidden_size}")
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if z is not None:
            x = x * F.silu(z.float())
        groups = x.reshape(*x.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (groups.reshape(x.shape) * self.weight.float()).to(dtype)
