"""Check ``_extra_state`` values of a loaded checkpoint before a module's ``set_extra_state`` unpickles them.

Transformer Engine modules store their FP8 scaling state as a uint8 tensor holding a plain
``pickle.dumps`` of a dict (the recipe object, scale / amax tensors, a few numbers), and their
``set_extra_state`` calls ``pickle.loads`` on whatever tensor the checkpoint holds (an older format,
an ``io.BytesIO``, goes to ``torch.load`` with its default). A checkpoint can put any pickle there.
``check_extra_states`` unpickles each such value first with an allow-list of what TE's state holds:
tensors (their storage read with ``weights_only=True``), ``OrderedDict``, torch dtypes, the
classes of ``transformer_engine.common.recipe``, and megatron-core's ``TEDelayedScaling`` (its
subclass of TE's ``DelayedScaling``: the recipe object of every ``fp8.recipe: delayed`` model, so
of every FP8 checkpoint of that recipe); anything else is refused, naming the key. Unpickling builds
a class instance from its pickled fields without calling its ``__init__``.
"""

from __future__ import annotations

import importlib
import io
from typing import Any

import torch

from megatron_cascade.checkpoint_safety.restricted_pickle import allow_list, restricted_loads, weights_only_load

_TE_RECIPE = "transformer_engine.common.recipe"
# megatron-core's recipe subclasses TE puts in _extra_state, exactly these classes.
_MEGATRON_RECIPES = {("megatron.core.extensions.transformer_engine", "TEDelayedScaling")}
_TENSOR_PARTS = allow_list([("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"),
                            ("torch", "Size")])


def _storage_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (how a pickled tensor's storage is stored) with ``weights_only``."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _te_allowed(module: str, name: str) -> Any:
    if (module, name) == ("torch.storage", "_load_from_bytes"):
        return _storage_from_bytes  # torch's own calls torch.load(weights_only=False)
    if module == "torch" and isinstance(vars(torch).get(name), (torch.dtype, torch.layout, torch.memory_format)):
        return vars(torch)[name]
    if module == _TE_RECIPE or (module, name) in _MEGATRON_RECIPES:  # recipe dataclasses and enums: plain data
        obj = getattr(importlib.import_module(module), name, None)
        return obj if isinstance(obj, type) and obj.__module__ == module else None
    return _TENSOR_PARTS(module, name)


def check_extra_states(state: dict[str, Any], ckpt_dir: str) -> None:
    """Raise ``UnsafeCheckpointError`` if an ``_extra_state`` value of ``state`` would run code when unpickled.

    ``state``: the module state dict loaded from the checkpoint in ``ckpt_dir`` (named in errors);
    nested dicts are walked too.
    """
    for key, value in state.items():
        if isinstance(value, dict):
            check_extra_states({f"{key}.{k}": v for k, v in value.items()}, ckpt_dir)
            continue
        if not str(key).endswith("_extra_state"):
            continue
        what = f"{ckpt_dir}: {key}"
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            data = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            restricted_loads(data, _te_allowed, what)
        elif isinstance(value, io.BytesIO):  # TE's older format, torch.load-ed by set_extra_state
            weights_only_load(io.BytesIO(value.getvalue()), what)
