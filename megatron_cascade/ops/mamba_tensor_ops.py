"""Torch stand-ins for what Mamba layers call under Megatron's dynamic (paged) inference context,
for CPU mode and GPU nodes without the mamba_ssm kernels (``torch_kernels.py``).

``MambaMixer._dynamic_inference`` (megatron-core 0.16.1) splits a packed step into decode and
prefill requests and moves rows between them with three Triton tensor ops
(``attention_context/triton/tensor_ops.py``); each request's conv and SSM state lives in a slot of
the context's state buffers, which ``causal_conv1d_update`` / ``selective_state_update`` (decode)
and ``causal_conv1d_varlen_states`` / ``mamba_chunk_scan_combined(return_varlen_states=True)``
(prefill) read and write by slot index. ``install()`` (called by ``enable_cpu_mode``) routes the
mixer to torch versions: same signatures and results (up to float rounding).
"""

from __future__ import annotations

from typing import Optional

import torch


def tensor_get_slice_after(input_tensor: torch.Tensor, output_tensor: torch.Tensor,
                           pos_on_device: torch.Tensor, check_bounds: bool = False) -> None:
    """``output[:n] = input[pos:]`` with ``n = len(input) - pos`` (rows of ``output`` beyond n untouched)."""
    pos = int(pos_on_device.reshape(-1)[0])
    rows = min(input_tensor.shape[0] - pos, output_tensor.shape[0])
    if rows > 0:
        output_tensor[:rows] = input_tensor[pos:pos + rows]


def tensor_merge(tensor_a: torch.Tensor, tensor_b: torch.Tensor, pos_on_device: torch.Tensor,
                 output_tensor: Optional[torch.Tensor] = None, check_bounds: bool = False) -> None:
    """``output[:pos] = a[:pos]`` and ``output[pos:pos + len(b)] = b`` (in place in ``a`` without
    ``output_tensor``), rows past ``len(output)`` dropped."""
    out = tensor_a if output_tensor is None else output_tensor
    pos = int(pos_on_device.reshape(-1)[0])
    if output_tensor is not None and pos > 0:
        out[:pos] = tensor_a[:pos]
    rows = min(tensor_b.shape[0], out.shape[0] - pos)
    if rows > 0:
        out[pos:pos + rows] = tensor_b[:rows]


def tensor_masked_update(states: torch.Tensor, idx: torch.Tensor, new_states: torch.Tensor) -> None:
    """``states[idx[i]] = new_states[i]`` for every ``idx[i] != -1`` (padding rows skipped)."""
    keep = idx >= 0
    states[idx[keep].long()] = new_states[keep].to(states.dtype)


TENSOR_OPS = {"tensor_get_slice_after": tensor_get_slice_after, "tensor_merge": tensor_merge,
              "tensor_masked_update": tensor_masked_update}


def install() -> None:
    """Route ``mamba_mixer`` to the torch tensor ops and decode / varlen kernels (``ops/mamba_reference.py``),
    and let its sequence-packing check for inference pass: the references honour ``seq_idx`` and
    ``cu_seqlens`` (the check asks for ``causal_conv1d`` / ``mamba_ssm`` versions)."""
    from megatron.core.ssm import mamba_mixer

    from megatron_cascade.ops import mamba_reference

    for name, fn in TENSOR_OPS.items():
        setattr(mamba_mixer, name, fn)
    mamba_mixer.causal_conv1d_fn = mamba_reference.causal_conv1d
    mamba_mixer.causal_conv1d_update = mamba_reference.causal_conv1d_update
    mamba_mixer.causal_conv1d_varlen_states = mamba_reference.causal_conv1d_varlen_states
    mamba_mixer.selective_state_update = mamba_reference.selective_state_update
    mamba_mixer._check_mamba_sequence_packing_support = lambda for_inference_not_training=True: (True, None)
