"""Write a Megatron distributed checkpoint (``torch_dist``) a few tensors at a time.

A ``torch_dist`` checkpoint is a PyTorch DCP checkpoint: data files plus one ``.metadata`` that
lists, for every key, its global shape and the chunks (offset, size) stored and where. Each
``write`` call saves its whole (TP=1) tensors with ``torch.distributed.checkpoint`` into a part
directory; ``finish`` moves the parts' data files into the output and writes one ``.metadata``
in which each tensor is a chunk of its Megatron key at the global offset Megatron gives it (its
layer, and expert, index on the stacked axes). Loading at any TP/PP/EP layout reads the overlaps
of the requested shards with those chunks, as for any checkpoint. The ``_extra_state`` objects,
``common.pt`` and ``metadata.json`` come from a regular ``dist_checkpointing.save`` of the
model's sharded objects. Peak memory: the tensors of one ``write`` call.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import asdict, dataclass, replace

import torch

from megatron_cascade.checkpoint_safety import read_dcp_metadata
from megatron_cascade.config.model import ModelConfig
from megatron_cascade.models.errors import ConversionError
from megatron_cascade.convert.runtime import Skeleton
from megatron_cascade.model.weights_checkpoint import MODEL_CONFIG_FILE, architecture_of

METADATA_FILE = ".metadata"
_PARTS = ".convert_parts"


def ensure_empty_dir(path: str) -> None:
    """Create ``path``; refuse (ConversionError) if it exists and is not empty."""
    if os.path.isdir(path) and os.listdir(path):
        raise ConversionError(f"output directory {path} is not empty; choose a new directory or empty it")
    os.makedirs(path, exist_ok=True)


def write_model_config(out_dir: str, model: ModelConfig) -> None:
    """``model_config.json`` in the format of ``save_model_weights`` (architecture + full config)."""
    with open(os.path.join(out_dir, MODEL_CONFIG_FILE), "w") as f:
        json.dump({"architecture": architecture_of(model), "config": asdict(model)}, f, indent=2)


@dataclass(frozen=True)
class Placement:
    """Where a whole TP=1 tensor lies in its checkpoint key: global shape and offset (stacked axes first)."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    prepend: int  # number of stacked axes (layer; layer and expert) before the tensor's own axes


def placement_of(entry) -> Placement:
    """The ``Placement`` of a skeleton entry (a ``ShardedTensor`` or a ``ShardedTensorFactory``).

    For a factory whose parts share one key (SwiGLU ``linear_fc1``) it covers all of them; for one that
    splits into several keys (Mamba ``in_proj``), it is the first part's: use ``pieces_of`` to write.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(entry, ShardedTensor):
        return Placement(entry.key, tuple(entry.global_shape), tuple(entry.global_offset), entry.prepend_axis_num)
    built = entry.build()
    parts = list(built.values()) if isinstance(built, dict) else list(built)
    offset = tuple(min(p.global_offset[i] for p in parts) for i in range(len(parts[0].global_offset)))
    return Placement(parts[0].key, tuple(parts[0].global_shape), offset, parts[0].prepend_axis_num)


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + length)`` (dim 0) of a whole TP=1 tensor, stored at ``placement``."""

    placement: Placement
    start: int
    length: int


def pieces_of(entry) -> list[Piece]:
    """Where each part of a skeleton entry is stored: one piece for a ``ShardedTensor``, one per part
    for a ``ShardedTensorFactory`` (SwiGLU [gate; up] under one key; Mamba ``in_proj`` as z/x/B/C/dt and
    ``conv1d`` as x/B/C under a key each, so that TP shards every part on its own).

    The parts of a factory are row ranges of the whole tensor; the range is read from the view's
    storage offset (the skeleton's tensors are contiguous, on the meta device).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(entry, ShardedTensor):
        return [Piece(placement_of(entry), 0, entry.data.shape[0])]
    whole = entry.data
    built = entry.build()
    pieces = []
    for part in (list(built.values()) if isinstance(built, dict) else list(built)):
        if tuple(part.data.shape[1:]) != tuple(whole.shape[1:]) or part.data.storage_offset() % whole.stride(0):
            raise ConversionError(f"{entry.key}: a checkpoint part that is not a row range of the tensor "
                                  f"({tuple(part.data.shape)} of {tuple(whole.shape)}) is not supported")
        place = Placement(part.key, tuple(part.global_shape), tuple(part.global_offset), part.prepend_axis_num)
        pieces.append(Piece(place, part.data.storage_offset() // whole.stride(0), part.data.shape[0]))
    return pieces


def piece_state_key(name: str, index: int) -> str:
    """The DCP state-dict key of piece ``index`` of tensor ``name`` inside a part file."""
    return f"{name}#{index}"


class DistCheckpointWriter:
    """Streams tensors of ``skeleton`` into a new distributed checkpoint in ``out_dir``."""

    def __init__(self, out_dir: str, skeleton: Skeleton, model: ModelConfig, dtype: torch.dtype):
        ensure_empty_dir(out_dir)
        self.out_dir = out_dir
        self.skeleton = skeleton
        self.model = model
        self.dtype = dtype
        self._placements: dict[str, Placement] = {}  # by piece state key
        self._written: set[str] = set()
        self._parts: list[str] = []

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Save ``tensors`` ({module name: whole TP=1 tensor}), cast to the checkpoint dtype."""
        import torch.distributed.checkpoint as dcp

        unknown = sorted(set(tensors) - set(self.skeleton.tensors))
        if unknown:
            raise ConversionError(f"the model has no tensors named {unknown[:5]}")
        again = sorted(set(tensors) & self._written)
        if again:
            raise ConversionError(f"tensors written twice: {again[:5]}")
        state = {}
        for name, tensor in tensors.items():
            self.skeleton.with_data(name, tensor)  # shape check
            dtype = self._dtype_of(name)
            for i, piece in enumerate(pieces_of(self.skeleton.tensors[name])):
                rows = tensor.narrow(0, piece.start, piece.length).to(dtype)
                key = piece_state_key(name, i)
                state[key] = rows.reshape((1,) * piece.placement.prepend + tuple(rows.shape)).contiguous()
                self._placements[key] = piece.placement
            self._written.add(name)
        part = self._new_part()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(part, thread_count=1), no_dist=True)

    def _dtype_of(self, name: str) -> torch.dtype:
        """The checkpoint dtype; tensors a 16-bit model keeps in float32 stay float32 (Megatron-Core holds
        the router's ``expert_bias`` and Mamba's ``A_log`` and ``D`` in float32 in every precision)."""
        if self.skeleton.tensors[name].data.dtype == torch.float32 and self.model.precision != "fp32":
            return torch.float32
        return self.dtype

    def _new_part(self) -> str:
        part = os.path.join(self.out_dir, _PARTS, str(len(self._parts)))
        os.makedirs(part)
        self._parts.append(part)
        return part

    def finish(self) -> None:
        """Check every tensor was written, merge the parts and write ``model_config.json``."""
        from megatron.core import dist_checkpointing

        missing = sorted(set(self.skeleton.tensors) - self._written)
        if missing:
            raise ConversionError(f"conversion did not produce {len(missing)} tensors, e.g. {missing[:5]}")
        objects_part = os.path.join(self.out_dir, _PARTS, "objects")
        os.makedirs(objects_part)
        dist_checkpointing.save(dict(self.skeleton.objects), objects_part, validate_access_integrity=False)
        merged = _read_part(objects_part, "objects", self.out_dir)
        for i, part in enumerate(self._parts):
            _merge_tensors(merged, _read_part(part, str(i), self.out_dir), self._placements)
        for name in ("common.pt", "metadata.json"):
            shutil.copy(os.path.join(objects_part, name), os.path.join(self.out_dir, name))
        with open(os.path.join(self.out_dir, METADATA_FILE), "wb") as f:
            pickle.dump(merged, f)
        shutil.rmtree(os.path.join(self.out_dir, _PARTS))
        write_model_config(self.out_dir, self.model)


def _read_part(part: str, tag: str, out_dir: str):
    """A part's DCP metadata, its data files moved to ``out_dir`` as ``__{tag}_{n}.distcp``."""
    meta = read_dcp_metadata(part)  # written just now by dcp.save; read like any other (allow-listed)
    renames = {}
    for name in os.listdir(part):
        if name.endswith(".distcp"):
            renames[name] = f"__{tag}_{name.rsplit('_', 1)[1]}"
            os.replace(os.path.join(part, name), os.path.join(out_dir, renames[name]))
    meta.storage_data = {i: replace(s, relative_path=renames[s.relative_path]) for i, s in meta.storage_data.items()}
    meta.storage_meta = None
    return meta


def _merge_tensors(into, part, placements: dict[str, Placement]) -> None:
    """Add the tensors of ``part`` (keyed by piece state key) to ``into`` as chunks of their checkpoint keys."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    for name, item in part.state_dict_metadata.items():
        place = placements[name]
        have = into.state_dict_metadata.get(place.key)
        if have is None:
            have = TensorStorageMetadata(item.properties, torch.Size(place.global_shape), [])
            into.state_dict_metadata[place.key] = have
        elif have.properties.dtype != item.properties.dtype:
            raise ConversionError(f"{place.key}: chunks of dtypes {have.properties.dtype} and {item.properties.dtype}")
        have.chunks.append(ChunkStorageMetadata(offsets=torch.Size(place.offset), sizes=item.size))
        (storage,) = [s for idx, s in part.storage_data.items() if idx.fqn == name]
        index = MetadataIndex(place.key, torch.Size(place.offset), len(have.chunks) - 1)
        into.storage_data[index] = storage
