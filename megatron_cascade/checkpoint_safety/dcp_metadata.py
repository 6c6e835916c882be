"""Read and check the ``.metadata`` of a PyTorch DCP / Megatron ``torch_dist`` checkpoint without running code.

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``: keys, global
shapes, dtypes, chunks and where each chunk is stored. ``read_dcp_metadata`` unpickles it with only
the classes such a file holds (DCP's metadata and save-plan dataclasses, ``torch.Size``, dtypes,
layouts, memory formats; Megatron's two legacy placeholder classes), then checks its structure:
shapes of non-negative ints, chunks inside their tensor, storage entries naming a plain file of the
directory (no ``../``), non-negative offsets and lengths, and at most ``MAX_CHUNKS`` chunks in all.
``check_data_spans`` adds that every data file exists and holds
each span it is said to hold (run before reading data: a forged length would otherwise be allocated whole).

Bounded work: the file is at most ``MAX_METADATA_BYTES`` (parsed at ~0.5 s/MiB here), and a loader's
work grows with chunks; a forged file of 1-element chunks stalled every loader for hours (7 s per MiB
of metadata). Megatron's sharded tensors stack layers (and a rank's local experts) into one tensor, so
a writer stores one chunk per layer, local expert, [gate; up] half and TP/EP shard: a 48-layer,
128-expert model (Qwen3-30B-A3B) has ~19K chunks, 12K of them in one tensor of one file, and a
DeepSeek-V3-sized one ~65K. ``MAX_CHUNKS`` (131K) leaves twice that; it also caps a forged file's
stall (its 1-element chunks cost loaders ~12 ms each: at most ~26 minutes, where 256 MiB of them took
hours). A legitimate load runs at ~2 ms per chunk here (48 layers x 32 experts: 6 s).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_cascade.checkpoint_safety.restricted_pickle import (
    UnsafeCheckpointError, allow_list, read_limited, restricted_loads,
)

METADATA_FILE = ".metadata"
# Megatron writes a few MB for 100B-parameter models at thousands of ranks; this parses in ~2 minutes.
MAX_METADATA_BYTES = 256 << 20
MAX_CHUNKS = 1 << 17
_META = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"
# What a .metadata written by torch 2.x DCP or Megatron-Core (0.15/0.16: ``all_local_plans``) holds.
_CLASSES = allow_list([
    (_META, "Metadata"), (_META, "TensorStorageMetadata"), (_META, "BytesStorageMetadata"),
    (_META, "ChunkStorageMetadata"), (_META, "TensorProperties"), (_META, "MetadataIndex"), (_META, "StorageMeta"),
    (_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    (_PLANNER, "SavePlan"), (_PLANNER, "WriteItem"), (_PLANNER, "WriteItemType"), (_PLANNER, "TensorWriteData"),
    (_PLANNER, "BytesIOWriteData"),
    (_MCORE, "MCoreMetadata"), (_MCORE, "MCoreSavePlan"),  # empty placeholders Megatron keeps for old files
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id given as a Path
])
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


def _allowed(module: str, name: str) -> Any:
    constant = vars(torch).get(name) if module == "torch" else None  # vars: no lazy submodule import
    if isinstance(constant, _TORCH_CONSTANTS):
        return constant  # torch.float32, torch.strided, torch.contiguous_format: constants, not callables
    return _CLASSES(module, name)


def read_dcp_metadata(ckpt_dir: str, filename: str = METADATA_FILE):
    """The checked ``Metadata`` of the DCP checkpoint in ``ckpt_dir``; no code runs, no tensor data is read.

    Raises ``FileNotFoundError`` if the file is missing, ``UnsafeCheckpointError`` (naming the file)
    if it names a class outside the allow-list, is corrupt or is structurally invalid.
    """
    path = os.path.join(str(ckpt_dir), filename)
    meta = restricted_loads(read_limited(path, MAX_METADATA_BYTES), _allowed, path)
    try:
        check_metadata(meta)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{path}: {exc}; re-copy or re-create the checkpoint") from None
    except (AttributeError, TypeError, ValueError, RecursionError) as exc:  # objects built without their fields
        raise UnsafeCheckpointError(f"{path}: invalid checkpoint metadata ({type(exc).__name__}: {exc}); "
                                    "re-copy or re-create the checkpoint") from None
    return meta


def check_metadata(meta: Any) -> None:
    """Raise ``UnsafeCheckpointError`` unless ``meta`` is a well-formed DCP ``Metadata``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    _require(type(meta) is Metadata, f"holds a {type(meta).__name__}, not a DCP Metadata")
    entries = meta.state_dict_metadata
    _require(isinstance(entries, dict), "state_dict_metadata is not a dict")
    _check_storage(meta.storage_data)
    chunks = sum(len(item.chunks) for item in entries.values() if isinstance(item, TensorStorageMetadata)
                 and isinstance(item.chunks, list))
    _require(chunks <= MAX_CHUNKS, f"{chunks} tensor chunks, more than the {MAX_CHUNKS} a checkpoint may have "
             "(Megatron writes one per layer, local expert and shard: ~19K for a 48-layer, 128-expert model)")
    checked: set[int] = set()  # entries shared through the pickle memo are checked once
    for key, item in entries.items():
        _require(isinstance(key, str), f"key {key!r} is not a string")
        if id(item) in checked:
            continue
        checked.add(id(item))
        if isinstance(item, TensorStorageMetadata):
            _check_tensor(key, item)
        else:
            _require(type(item) is BytesStorageMetadata, f"{key}: entry of type {type(item).__name__}")


def _check_tensor(key: str, item: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    _require(type(item.properties) is TensorProperties and isinstance(item.properties.dtype, torch.dtype),
             f"{key}: no valid dtype")
    size = _shape(item.size, f"{key}: global shape")
    _require(isinstance(item.chunks, list), f"{key}: chunks is not a list")
    for chunk in item.chunks:
        _require(type(chunk) is ChunkStorageMetadata, f"{key}: a chunk of type {type(chunk).__name__}")
        offsets = _shape(chunk.offsets, f"{key}: chunk offsets")
        sizes = _shape(chunk.sizes, f"{key}: chunk sizes")
        _require(len(offsets) == len(sizes) == len(size), f"{key}: chunk of rank {len(sizes)}, tensor of {len(size)}")
        _require(all(o + s <= g for o, s, g in zip(offsets, sizes, size)),
                 f"{key}: chunk at {list(offsets)} of {list(sizes)} outside the tensor {list(size)}")


def _shape(value: Any, what: str) -> tuple[int, ...]:
    _require(isinstance(value, torch.Size), f"{what} is not a torch.Size")
    _require(all(type(d) is int and d >= 0 for d in value), f"{what} {list(value)} has a negative or non-int entry")
    return tuple(value)


def _check_storage(storage: Any) -> None:
    """Check every storage entry (one per chunk and per bytes item)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if storage is None:  # metadata written without storage info (never by FileSystemWriter)
        return
    _require(isinstance(storage, dict), "storage_data is not a dict")
    _require(len(storage) <= 2 * MAX_CHUNKS, f"{len(storage)} storage entries, more than twice the {MAX_CHUNKS} "
             "chunks a checkpoint may have")
    for index, info in storage.items():
        _require(type(index) is MetadataIndex and isinstance(index.fqn, str), "a storage key is not a MetadataIndex")
        _require(type(info) is _StorageInfo, f"{index.fqn}: storage entry of type {type(info).__name__}")
        name = info.relative_path
        _require(isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name
                 and "\\" not in name and "\0" not in name,
                 f"{index.fqn}: data file {name!r} is not a plain file name inside the checkpoint directory")
        _require(type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0,
                 f"{index.fqn}: span offset={info.offset!r} length={info.length!r} is not two non-negative ints")
        descriptors = info.transform_descriptors
        _require(descriptors is None or (isinstance(descriptors, (list, tuple))
                                         and all(isinstance(d, str) for d in descriptors)),
                 f"{index.fqn}: transform descriptors {descriptors!r} are not strings")


def check_data_spans(ckpt_dir: str, meta: Any) -> None:
    """Raise ``UnsafeCheckpointError`` unless every data file of ``meta`` exists and holds its spans."""
    sizes: dict[str, int] = {}
    for index, info in (meta.storage_data or {}).items():
        name = info.relative_path
        if name not in sizes:
            path = os.path.join(str(ckpt_dir), name)
            if not os.path.isfile(path):
                raise UnsafeCheckpointError(f"{ckpt_dir}: data file {name} (of {index.fqn}) is missing; "
                                            "the checkpoint is incomplete: re-copy it")
            sizes[name] = os.path.getsize(path)
        if info.offset + info.length > sizes[name]:
            raise UnsafeCheckpointError(
                f"{os.path.join(str(ckpt_dir), name)} is truncated or forged: {index.fqn} is said to span bytes "
                f"[{info.offset}, {info.offset + info.length}), the file has {sizes[name]}; re-copy the checkpoint")


def _require(ok: bool, problem: str) -> None:
    if not ok:
        raise UnsafeCheckpointError(f"invalid checkpoint metadata: {problem}")
