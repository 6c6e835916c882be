"""The pure-torch Mamba-2 kernels (ops/mamba_reference.py) against a naive float64 recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_cascade.ops.mamba_reference import (
    GatedRMSNorm,
    causal_conv1d,
    causal_conv1d_update,
    causal_conv1d_varlen_states,
    mamba_chunk_scan_combined,
    mamba_split_conv1d_scan_combined,
    selective_state_update,
)
from megatron_cascade.testing.device_naming import factories_name_their_device


@pytest.fixture(autouse=True)
def _stand_ins_name_their_device():
    """The stand-ins also run on a GPU machine without the CUDA kernels (``torch_kernels.py``): no
    tensor of theirs may land on the default device (on a GPU: a CPU tensor beside CUDA ones)."""
    with factories_name_their_device(["megatron_cascade.ops.mamba_reference",
                                      "megatron_cascade.ops.mamba_tensor_ops"]):
        yield


def naive_scan(x, dt, A, B, C, D, z=None, dt_bias=None, seq_idx=None, initial=None):
    """Token-by-token recurrence in float64: S = exp(dt A) S + dt x B^T, y = S C + D x."""
    x, dt, A, B, C, D = (t.double() for t in (x, dt, A, B, C, D))
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dt = F.softplus(dt + dt_bias.double()) if dt_bias is not None else dt
    B = B.repeat_interleave(h // g, dim=2)
    C = C.repeat_interleave(h // g, dim=2)
    y = torch.zeros_like(x)
    state = torch.zeros(b, h, p, n, dtype=torch.float64) if initial is None else initial.double().clone()
    for t in range(l):
        if seq_idx is not None and t > 0:
            restart = (seq_idx[:, t] != seq_idx[:, t - 1]).double().view(b, 1, 1, 1)
            state = state * (1 - restart)
        decay = torch.exp(dt[:, t] * A).view(b, h, 1, 1)
        state = decay * state + (dt[:, t].view(b, h, 1, 1) * x[:, t].unsqueeze(-1) * B[:, t].unsqueeze(2))
        y[:, t] = torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D.view(1, h, -1) * x[:, t]
    if z is not None:
        y = y * F.silu(z.double())
    return y, state


def naive_conv(x, weight, bias, seq_idx=None):
    b, d, l = x.shape
    w = weight.shape[1]
    out = torch.zeros(b, d, l, dtype=torch.float64)
    for t in range(l):
        for k in range(w):
            s = t - (w - 1) + k
            if s < 0:
                continue
            if seq_idx is not None:
                ok = (seq_idx[:, s] == seq_idx[:, t]).double().view(b, 1)
            else:
                ok = 1.0
            out[:, :, t] += ok * weight[:, k].double() * x[:, :, s].double()
    return F.silu(out + bias.double().view(1, d, 1))


def _inputs(b=2, l=13, h=4, p=3, g=2, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    return dict(x=r(b, l, h, p), dt=r(b, l, h), A=-torch.rand(h, generator=gen) * 2 - 0.1,
                B=r(b, l, g, n), C=r(b, l, g, n), D=r(h), z=r(b, l, h, p), dt_bias=r(h) * 0.5)


@pytest.mark.parametrize("chunk", [4, 5, 13, 64])
def test_chunk_scan_matches_naive_recurrence(chunk):
    i = _inputs()
    seq_idx = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2, [0] * 13], dtype=torch.int32)
    initial = torch.randn(2, 4, 3, 5)
    y, final = mamba_chunk_scan_combined(i["x"], i["dt"], i["A"], i["B"], i["C"], chunk, D=i["D"], z=i["z"],
                                         dt_bias=i["dt_bias"], dt_softplus=True, seq_idx=seq_idx,
                                         initial_states=initial, return_final_states=True)
    ref_y, ref_state = naive_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], z=i["z"], dt_bias=i["dt_bias"],
                                  seq_idx=seq_idx, initial=initial)
    assert (y.double() - ref_y).abs().max() < 1e-4
    assert (final.double() - ref_state).abs().max() < 1e-4


def test_chunk_scan_initial_state_continues_a_split_sequence():
    """Scanning [0, 7) then [7, 13) from the first part's final state equals one scan: the
    chunked-prefill / decode contract."""
    i = _inputs(b=1)
    args = lambda sl: (i["x"][:, sl], i["dt"][:, sl], i["A"], i["B"][:, sl], i["C"][:, sl], 4)
    kw = dict(D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True, return_final_states=True)
    y_all, s_all = mamba_chunk_scan_combined(*args(slice(0, 13)), **kw)
    y1, s1 = mamba_chunk_scan_combined(*args(slice(0, 7)), **kw)
    y2, s2 = mamba_chunk_scan_combined(*args(slice(7, 13)), initial_states=s1, **kw)
    assert torch.allclose(torch.cat([y1, y2], 1), y_all, atol=1e-5)
    assert torch.allclose(s2, s_all, atol=1e-5)


def test_varlen_states_are_each_sequences_final_state():
    i = _inputs(b=1)
    cu = torch.tensor([0, 5, 11, 13])
    seq_idx = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2])
    _, _, states = mamba_chunk_scan_combined(i["x"], i["dt"], i["A"], i["B"], i["C"], 4, D=i["D"],
                                             dt_bias=i["dt_bias"], dt_softplus=True, seq_idx=seq_idx,
                                             cu_seqlens=cu, return_final_states=True, return_varlen_states=True)
    for k, (s, e) in enumerate([(0, 5), (5, 11), (11, 13)]):
        sl = slice(s, e)
        _, ref = naive_scan(i["x"][:, sl], i["dt"][:, sl], i["A"], i["B"][:, sl], i["C"][:, sl], i["D"],
                            dt_bias=i["dt_bias"])
        assert (states[k].double() - ref[0]).abs().max() < 1e-4


def test_causal_conv_respects_sequences_and_initial_state():
    gen = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(2, 6, 11, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    seq_idx = torch.tensor([[0] * 3 + [1] * 8, [0] * 7 + [1] * 4])
    out = causal_conv1d(x, w, bias, seq_idx=seq_idx, activation="silu")
    assert (out.double() - naive_conv(x, w, bias, seq_idx)).abs().max() < 1e-5
    # initial_states = the 3 tokens before: the same as convolving the longer sequence.
    full = torch.randn(2, 6, 14, generator=gen)
    tail = causal_conv1d(full[:, :, 3:], w, bias, initial_states=full[:, :, :3], activation="silu")
    assert torch.allclose(tail, causal_conv1d(full, w, bias, activation="silu")[:, :, 3:], atol=1e-6)


def test_split_conv1d_scan_matches_conv_then_naive_scan_with_grads():
    b, l, h, p, g, n, w = 2, 9, 4, 3, 2, 5, 4
    gen = torch.Generator().manual_seed(2)
    dim, conv_dim = h * p, h * p + 2 * g * n
    zxbcdt = torch.randn(b, l, 2 * dim + 2 * g * n + h, generator=gen, requires_grad=True)
    cw, cb = torch.randn(conv_dim, w, generator=gen), torch.randn(conv_dim, generator=gen)
    dt_bias, A, D = torch.randn(h, generator=gen), -torch.rand(h, generator=gen) - 0.1, torch.randn(h, generator=gen)
    seq_idx = torch.tensor([[0] * 4 + [1] * 5] * 2, dtype=torch.int32)
    out = mamba_split_conv1d_scan_combined(zxbcdt, cw, cb, dt_bias, A, D, 4, seq_idx=seq_idx, headdim=p, ngroups=g)

    z, xbc, dt = torch.split(zxbcdt.double(), [dim, conv_dim, h], dim=-1)
    xbc = naive_conv(xbc.transpose(1, 2), cw, cb, seq_idx).transpose(1, 2)
    x, B, C = torch.split(xbc, [dim, g * n, g * n], dim=-1)
    ref, _ = naive_scan(x.reshape(b, l, h, p), dt, A, B.reshape(b, l, g, n), C.reshape(b, l, g, n), D,
                        z=z.reshape(b, l, h, p), dt_bias=dt_bias, seq_idx=seq_idx)
    ref = ref.reshape(b, l, dim)
    assert (out.double() - ref).abs().max() < 1e-4
    grad_out = torch.randn(b, l, dim, generator=gen)
    (grad,) = torch.autograd.grad((out * grad_out).sum(), zxbcdt)
    (ref_grad,) = torch.autograd.grad((ref * grad_out.double()).sum(), zxbcdt)
    assert (grad.double() - ref_grad).abs().max() < 1e-3


def test_gated_rmsnorm_normalises_each_group():
    norm = GatedRMSNorm(8, eps=1e-5, group_size=4)
    norm.weight.data = torch.arange(8.0)
    x, z = torch.randn(3, 8), torch.randn(3, 8)
    gated = (x * F.silu(z)).double()
    ref = torch.cat([gx * torch.rsqrt(gx.pow(2).mean(-1, keepdim=True) + 1e-5) for gx in gated.split(4, -1)], -1)
    assert torch.allclose(norm(x, z).double(), ref * torch.arange(8.0).double(), atol=1e-5)


def test_decode_kernels_step_the_naive_recurrence_in_state_slots():
    """Paged decoding: the state of each batch row lives in a slot of a larger buffer (slots 3 and
    0 of 4; a -1 row is padding and must touch nothing). Stepping ``causal_conv1d_update`` and
    ``selective_state_update`` token by token gives the float64 conv and recurrence (the SSM step
    computes in float32, as mamba_ssm's kernel)."""
    inp = _inputs(b=2, l=6)
    h, p, n = 4, 3, 5
    d, w = 7, 4
    gen = torch.Generator().manual_seed(1)
    xc, weight, bias = torch.randn(2, d, 6, generator=gen), torch.randn(d, w, generator=gen), torch.randn(d, generator=gen)
    conv_ref = naive_conv(xc, weight, bias)
    y_ref, state_ref = naive_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], z=inp["z"],
                                  dt_bias=inp["dt_bias"])
    conv_state = torch.full((4, d, w), 0.0, dtype=torch.float64)
    ssm_state = torch.zeros(4, h, p, n, dtype=torch.float64)
    untouched = torch.randn(4, h, p, n, dtype=torch.float64, generator=gen)
    ssm_state[1:3] = untouched[1:3]
    conv_state[1:3] = 7.0
    slots = torch.tensor([3, 0, -1])  # the third row is padding
    pad = lambda t: torch.cat([t, t[:1]])  # noqa: E731
    for t in range(6):
        conv_out = causal_conv1d_update(pad(xc[:, :, t].double()), conv_state, weight.double(), bias.double(),
                                        "silu", conv_state_indices=slots)
        torch.testing.assert_close(conv_out[:2], conv_ref[:, :, t], rtol=1e-10, atol=1e-10)
        y = selective_state_update(
            ssm_state, pad(inp["x"][:, t].double()), pad(inp["dt"][:, t].double()).unsqueeze(-1).expand(-1, h, p),
            inp["A"].double().view(h, 1, 1).expand(h, p, n), pad(inp["B"][:, t].double()),
            pad(inp["C"][:, t].double()), D=inp["D"].double().view(h, 1).expand(h, p),
            z=pad(inp["z"][:, t].double()), dt_bias=inp["dt_bias"].double().view(h, 1).expand(h, p),
            dt_softplus=True, state_batch_indices=slots)
        torch.testing.assert_close(y[:2], y_ref[:, t], rtol=1e-5, atol=1e-5)  # float32 math, as the kernel's
    torch.testing.assert_close(ssm_state[[3, 0]], state_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ssm_state[1:3], untouched[1:3]) and torch.equal(conv_state[1:3], torch.full((2, d, w), 7.0,
                                                                                                   dtype=torch.float64))


def test_conv_varlen_states_are_each_sequences_last_inputs():
    """After a packed prefill, each sequence's conv window: its last ``w`` inputs, zeros before its start."""
    x = torch.arange(2 * 9, dtype=torch.float64).view(9, 2)  # 9 tokens of 2 channels: sequences of 5, 1, 3
    states = causal_conv1d_varlen_states(x, torch.tensor([0, 5, 6, 9]), state_len=4)
    assert states.shape == (3, 2, 4)
    torch.testing.assert_close(states[0], x[1:5].T)
    torch.testing.assert_close(states[1], torch.cat([torch.zeros(2, 3, dtype=torch.float64), x[5:6].T], dim=1))
    torch.testing.assert_close(states[2], torch.cat([torch.zeros(2, 1, dtype=torch.float64), x[6:9].T], dim=1))
