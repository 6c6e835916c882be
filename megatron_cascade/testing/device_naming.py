"""A check, on CPU, that code meant to run on a GPU too creates no tensor on the default device.

The torch stand-ins for CUDA-extension kernels (``ops/paged_attention_reference.py``,
``ops/mamba_tensor_ops.py``, ``ops/mamba_reference.py``) also serve a CUDA machine that has only
torch (``megatron_cascade/torch_kernels.py``). There a factory call without ``device=`` makes a CPU
tensor beside CUDA ones, and the first op mixing them fails; on CPU every tensor is on the one device,
so the tests cannot see it. ``factories_name_their_device(modules)`` makes them see it: a factory call
made directly from one of ``modules`` without a ``device`` argument raises.
"""

from __future__ import annotations

import sys
from typing import Iterable

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.empty, torch.full,
                        torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye})


class DeviceUnnamedError(AssertionError):
    """A tensor factory called without ``device=`` from code that must also run on a GPU."""


class factories_name_their_device(TorchFunctionMode):  # noqa: N801 - used as a context manager
    """While active, a tensor factory called from one of ``modules`` (by ``__name__``) without
    ``device=`` raises ``DeviceUnnamedError`` naming the caller's file and line."""

    def __init__(self, modules: Iterable[str]) -> None:
        super().__init__()
        self.modules = frozenset(modules)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and "device" not in kwargs:
            caller = sys._getframe(1)
            if caller.f_globals.get("__name__") in self.modules:
                raise DeviceUnnamedError(f"{caller.f_code.co_filename}:{caller.f_lineno}: torch.{func.__name__}(...) "
                                         "without device=: a CPU tensor on a GPU machine")
        return func(*args, **kwargs)
