"""Run Megatron-Core on CPU (gloo): the runtime behind the tiny demo, CPU training and the tests.

Megatron-Core assumes CUDA in a handful of places that have nothing to do with the math:
the pipeline schedules and buffers allocate with ``device="cuda"`` / ``torch.cuda.current_device()``,
the tensor-parallel RNG tracker saves and restores CUDA generator states, and the overlap code
creates CUDA streams and events. ``enable_cpu_mode()`` redirects exactly those, and nothing else:

* a ``TorchFunctionMode`` that rewrites a CUDA ``device`` argument of factory calls and of
  ``Tensor.to``/``Tensor.cuda`` to CPU;
* ``torch.cuda.current_device`` returns ``"cpu"`` (usable as a ``device=`` argument);
* the tensor-parallel RNG tracker stores the CPU generator state instead of a CUDA one;
* ``torch.cuda.Stream/Event/synchronize/...`` become no-ops;
* the MoE router's Transformer-Engine-only GEMM becomes ``F.linear``;
* gradient clipping scales grads without asserting they are CUDA tensors;
* while Megatron's mixed-precision and distributed optimizers are built (only then), CPU tensors
  report ``torch.cuda.*Tensor`` type names: both sort parameters into fp16/bf16 vs fp32 groups by
  ``param.type()`` and refuse anything but CUDA names (bf16/fp16 training with fp32 master weights);
* ``all_to_all_single`` gets its split sizes as lists (gloo rejects the numpy arrays the MoE
  alltoall dispatcher passes);
* the flash-attn paged-KV kernels of Megatron's dynamic inference attention get torch stand-ins
  (``megatron_cascade/ops/paged_attention_reference.py``), and its Triton KV-append kernel is
  switched off: with a CUDA torch wheel ``import triton`` succeeds on a machine without a GPU,
  and Megatron takes a Triton path whenever it can import Triton, whatever the device;
* Mamba-2 layers (hybrid models) get pure-torch kernels for the ``mamba_ssm`` / ``causal_conv1d``
  ones they call (``megatron_cascade/ops/mamba_reference.py``; see ``torch_kernels.install_mamba``).

It is a process-wide switch: call it once, before building models, in every worker process.
On a machine with a GPU do not call it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megatron_cascade import run_logging, torch_kernels

_ENABLED = False
_MODE: TorchFunctionMode | None = None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU in every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NoOpStream:
    """Stand-in for ``torch.cuda.Stream``/``Event``: every method is a no-op.

    Methods return another stand-in, since callers chain them (``stream.record_event().synchronize()``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str):
        return lambda *a, **k: _NoOpStream()

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _patch_cuda_runtime() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpStream
    cuda.current_stream = lambda *a, **k: _NoOpStream()
    cuda.default_stream = lambda *a, **k: _NoOpStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_device = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    # torch.manual_seed calls cuda.manual_seed_all: that must not recurse. Megatron's RNG tracker
    # seeds "the CUDA generator" to capture a state; on CPU that is the default generator.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0


def _patch_all_to_all() -> None:
    """Gloo's ``all_to_all_single`` takes split sizes as lists only; MoE's alltoall passes numpy arrays."""
    import torch.distributed as dist

    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        return original(output, input, _as_list(output_split_sizes), _as_list(input_split_sizes), *args, **kwargs)

    dist.all_to_all_single = all_to_all_single


def _as_list(sizes):
    return sizes.tolist() if hasattr(sizes, "tolist") else sizes


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils, router

    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    def router_gating_linear(inp, weight, bias, router_dtype):
        return F.linear(inp.to(router_dtype), weight.to(router_dtype), bias)

    moe_utils.router_gating_linear = router_gating_linear
    router.router_gating_linear = router_gating_linear
    _patch_grad_clipping()
    _patch_optimizer_type_checks()
    _patch_paged_attention()
    _quiet_rng_fork_notice()
    torch_kernels.install_mamba(local_final_norm=True)


class _DropMessage(logging.Filter):
    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def _quiet_rng_fork_notice() -> None:
    """The RNG tracker's ``fork()`` logs "CPU RNG state changed within GPU RNG context" when the CPU
    generator moved inside it. In CPU mode the "CUDA" generator *is* the CPU one (the tracker saves
    and restores it around the block), so every initialisation inside a fork (the Mamba mixer's conv
    and dt/A init) would log it: expected here, and nothing is lost."""
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(
        _DropMessage("CPU RNG state changed within GPU RNG context"))


def _patch_paged_attention() -> None:
    """Torch stand-ins for the flash-attn paged-KV kernels of Megatron's dynamic inference path
    (``generate`` runs on a ``DynamicInferenceContext``), and its Triton KV append off."""
    from megatron.core.inference.contexts import dynamic_context

    torch_kernels.install_paged_attention()
    dynamic_context.triton_append_key_value_cache = None  # its torch fallback (the Triton one asserts CUDA)


@contextlib.contextmanager
def _cuda_type_names():
    """While active, ``tensor.type()`` on a CPU tensor answers ``torch.cuda.<X>Tensor``.

    Re-entrant: CPU mode's TorchFunctionMode calls back into the patched method with the
    original ``Tensor.type``, whose answer may already carry the ``torch.cuda.`` name.
    """
    patched_already = "type" in vars(torch.Tensor)  # by an enclosing use
    previous = torch.Tensor.type
    original = torch._C.TensorBase.type

    def type_name(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(out, str) or out.startswith("torch.cuda."):
            return out  # a conversion (``t.type(dtype)``), or already a CUDA name
        return "torch.cuda." + out[len("torch."):]

    torch.Tensor.type = type_name
    try:
        yield
    finally:
        if patched_already:
            torch.Tensor.type = previous
        else:
            del torch.Tensor.type  # back to the inherited method


def _with_cuda_type_names(cls) -> None:
    """Run ``cls.__init__`` under ``_cuda_type_names`` (the type strings only group parameters
    by dtype; nothing CUDA-specific follows from them under CPU mode)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        with _cuda_type_names():
            init(self, *args, **kwargs)

    cls.__init__ = __init__


def _patch_optimizer_type_checks() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    _with_cuda_type_names(Float16OptimizerWithFloat16Params)
    _with_cuda_type_names(DistributedOptimizer)


def _patch_grad_clipping() -> None:
    """Megatron's clip asserts ``torch.cuda.FloatTensor`` grads; the same scaling, on any device."""
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def enable_cpu_mode() -> None:
    """Make Megatron-Core runnable on CPU in this process (idempotent)."""
    global _ENABLED, _MODE
    if _ENABLED:
        return
    run_logging.silence_cpu_warnings()
    _patch_cuda_runtime()
    _patch_all_to_all()
    _patch_megatron()
    _MODE = _CudaDeviceToCpu()
    _MODE.__enter__()
    _ENABLED = True


@contextlib.contextmanager
def device_rewrite_paused() -> Iterator[None]:
    """Run the block without CPU mode's device-rewriting ``TorchFunctionMode`` (it adds a Python
    call to every torch op), for code that creates no tensors on a CUDA device: the decode loop once
    the model and the KV cache exist (a GRPO step's rollouts on 4 layers x 256: 0.236 -> 0.168 s, the
    same tokens). A CUDA-device tensor created inside fails loudly (CPU torch has no CUDA).

    A no-op outside CPU mode, or when another mode sits above CPU mode's on the stack.
    """
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if _MODE is None or _get_current_function_mode() is not _MODE:
        yield
        return
    with _pop_mode_temporarily():
        yield


def cpu_mode_enabled() -> bool:
    """Whether ``enable_cpu_mode()`` has run in this process."""
    return _ENABLED
