"""A single-process Megatron-Core runtime for conversion, and the weight-free model skeleton.

Conversion never materialises a model: it builds the ``GPTModel`` on the ``meta`` device (no
memory) only to get its ``sharded_state_dict``, i.e. the exact checkpoint keys, global shapes and
offsets Megatron uses at any layout, then fills those entries with real tensors a layer at a time.
Checkpoint keys are the canonical (Transformer Engine spec) ones of ``model.spec_layout``, whichever
spec builds the skeleton, so converted checkpoints load into the TE model on GPU.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from megatron_cascade.config.model import ModelConfig, ParallelConfig
from megatron_cascade.models.errors import ConversionError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def hide_gpus() -> None:
    """Hide CUDA devices from this process (``CUDA_VISIBLE_DEVICES=""``), before anything initialises CUDA.

    Conversion is CPU work: with a GPU visible the model builder would pick the Transformer Engine
    spec and move the meta-device skeleton to the GPU. The ``convert`` commands call this first, so
    they run unchanged on a GPU node. A no-op once CUDA is initialised (``megatron_runtime`` then refuses).
    """
    if not torch.cuda.is_initialized():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@contextlib.contextmanager
def megatron_runtime() -> Iterator[None]:
    """Megatron parallel state for one process at TP=PP=EP=1 (torch.distributed via gloo), in CPU mode.

    Reuses an initialised single-process state; otherwise creates one and tears it down on exit.
    Enables Megatron-Core's CPU mode for the whole process; raises ``ConversionError`` if a GPU is
    visible (call ``hide_gpus`` first, or set ``CUDA_VISIBLE_DEVICES=``).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_cascade.cpu_runtime import enable_cpu_mode
    from megatron_cascade.model import initialize_model_parallel

    if torch.cuda.is_available():
        raise ConversionError("conversion runs on CPU but this process sees a GPU: run it with "
                              "CUDA_VISIBLE_DEVICES= (the convert commands do so themselves)")
    enable_cpu_mode()
    own_dist = not dist.is_initialized()
    if own_dist:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise ConversionError("conversion runs in one process; torch.distributed has "
                              f"{dist.get_world_size()} ranks here (run it outside torchrun)")
    own_mp = not parallel_state.model_parallel_is_initialized()
    if own_mp:
        initialize_model_parallel(ParallelConfig(), seed=0)
    try:
        yield
    finally:
        if own_mp:
            parallel_state.destroy_model_parallel()
        if own_dist:
            dist.destroy_process_group()


@dataclass
class Skeleton:
    """The sharded-state-dict entries of a TP=PP=EP=1 model, by module name (``prefix`` stripped).

    ``tensors`` holds ``ShardedTensor`` / ``ShardedTensorFactory`` entries (their ``data`` on the
    meta device), ``objects`` the ``ShardedObject`` entries (``_extra_state``).
    """

    tensors: dict[str, Any]
    objects: dict[str, Any]
    prefix: str = ""

    def layer_names(self, layer: int) -> list[str]:
        """Tensor names of decoder layer ``layer``."""
        return [n for n in self.tensors if layer_of(n) == layer]

    def global_names(self) -> list[str]:
        """Tensor names outside the decoder layers."""
        return [n for n in self.tensors if layer_of(n) is None]

    def local_shape(self, name: str) -> tuple[int, ...]:
        """Shape of the whole (TP=1) tensor ``name``."""
        return tuple(self.tensors[name].data.shape)

    def checkpoint_key(self, name: str) -> str:
        """The key ``name`` is stored under in the distributed checkpoint."""
        return self.tensors[name].key

    def with_data(self, name: str, data: torch.Tensor):
        """The entry ``name`` holding ``data`` (shape-checked) instead of its meta tensor."""
        entry = self.tensors[name]
        if tuple(data.shape) != self.local_shape(name):
            raise ConversionError(f"tensor {name} has shape {tuple(data.shape)}, the model needs "
                                  f"{self.local_shape(name)}; the checkpoint does not match its config")
        if hasattr(entry, "dtype"):
            return replace(entry, data=data, dtype=data.dtype)
        return replace(entry, data=data)


def layer_of(name: str) -> int | None:
    """The decoder layer index in a module name, or None outside the layers."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def build_skeleton(model: ModelConfig, prefix: str = "") -> Skeleton:
    """The checkpoint structure of ``model`` (inside ``megatron_runtime``); keys get ``prefix`` prepended.

    Checkpoint keys are canonical (``model.spec_layout``).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_cascade.model import build_gpt_model
    from megatron_cascade.model.spec_layout import canonical_sharded_state_dict

    with torch.device("meta"):
        gpt = build_gpt_model(model, ParallelConfig())
    entries = canonical_sharded_state_dict(gpt.sharded_state_dict(prefix=prefix))
    strip = len(prefix)
    tensors = {k[strip:]: v for k, v in entries.items() if not isinstance(v, ShardedObject)}
    objects = {k[strip:]: v for k, v in entries.items() if isinstance(v, ShardedObject)}
    return Skeleton(tensors, objects, prefix)
