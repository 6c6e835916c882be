"""``dist_checkpointing.load`` strategies for ``torch_dist`` checkpoints that never unpickle code.

Megatron-Core 0.16.1 with torch 2.13 reads three kinds of pickles from a ``torch_dist`` checkpoint:
* ``.metadata``: ``FileSystemReader.read_metadata`` calls ``pickle.load`` (any class, any callable);
* sharded objects (``_extra_state``, stored as bytes in the ``.distcp`` data files): DCP's
  ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)``;
* ``common.pt``: ``torch.load`` with its default, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns
  into ``weights_only=False``.
(Tensor chunks are read with ``weights_only=True``, ``metadata.json`` is JSON.) The strategies here
read ``.metadata`` with the allow-list of ``dcp_metadata`` (and check every data span against its
file before any read), sharded objects and ``common.pt`` with ``torch.load(weights_only=True)``.
Anything else is refused with ``UnsafeCheckpointError`` naming the file, on every rank.
``SafeTorchDistLoadStrategy.load`` mirrors ``TorchDistLoadShardedStrategy.load`` of Megatron-Core
0.16.1, with the safe reader and planner in place of the default ones.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, Optional

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from megatron_cascade.checkpoint_safety.dcp_metadata import METADATA_FILE, check_data_spans, read_dcp_metadata
from megatron_cascade.checkpoint_safety.restricted_pickle import (
    UnsafeCheckpointError, refusal_reason, weights_only_load,
)


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` is allow-listed and span-checked (and cached)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._metadata: dict[Optional[int], Any] = {}

    def read_metadata(self, *args: Any, **kwargs: Any):
        """The checked ``Metadata`` (``rank=r``: the per-rank ``__r.metadata``), read once per reader."""
        rank = kwargs.get("rank")
        if rank not in self._metadata:
            name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
            meta = read_dcp_metadata(str(self.path), name)
            check_data_spans(str(self.path), meta)
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            self._metadata[rank] = meta
        return self._metadata[rank]


class SafeLoadPlanner(mcore_torch.MCoreLoadPlanner):
    """Megatron's load planner with sharded objects read by ``torch.load(weights_only=True)``.

    ``ckpt_dir`` only names the data file in errors; other arguments are ``MCoreLoadPlanner``'s.
    """

    def __init__(self, *args: Any, ckpt_dir: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ckpt_dir = str(ckpt_dir)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Store the object of ``read_item`` (refused with ``UnsafeCheckpointError`` unless plain data)."""
        fqn = read_item.dest_index.fqn
        stored = self.metadata.storage_data.get(read_item.storage_index) if self.metadata is not None else None
        where = os.path.join(self.ckpt_dir, stored.relative_path) if stored is not None else self.ckpt_dir
        obj = weights_only_load(value, f"object {read_item.storage_index.fqn} in {where}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def unsafe_cause(exc: BaseException, ckpt_dir: str) -> Optional[UnsafeCheckpointError]:
    """The ``UnsafeCheckpointError`` behind ``exc`` (DCP wraps per-rank failures in ``CheckpointException``);
    a tensor chunk that torch's ``weights_only`` load refused counts too (DCP does not say which file)."""
    stack, seen = [exc], set()
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, UnsafeCheckpointError):
            return err
        if isinstance(err, pickle.UnpicklingError):
            return UnsafeCheckpointError(
                f"{ckpt_dir}: a tensor chunk in a .distcp data file is not plain data: {refusal_reason(err)}; "
                "refused (it could run code). Re-create the checkpoint with megatron-cascade or take it from a "
                "source you trust")
        stack += [err.__cause__, err.__context__]
        if isinstance(err, CheckpointException):
            stack += [pair[0] for pair in err.failures.values()]
    return None


class SafeTorchDistLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """``TorchDistLoadShardedStrategy`` reading through ``SafeFileSystemReader`` and ``SafeLoadPlanner``."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """Load ``sharded_state_dict`` from ``checkpoint_dir`` (Megatron's ``load``, safe reader and planner)."""
        flexible_shape = [t for t in mcore_torch.nested_values(sharded_state_dict)
                          if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        allow_mismatch = {t.key: t for t in mcore_torch.nested_values(sharded_state_dict)
                          if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        orig_sharded_state_dict = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = (
            mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict))
        pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = SafeFileSystemReader(checkpoint_dir)
        reader.read_metadata()  # refused here, before DCP, with the plain error
        planner = SafeLoadPlanner(shapes_validation_sharded_tensors=flexible_shape,
                                  allow_shape_mismatch_sharded_tensors=allow_mismatch, ckpt_dir=checkpoint_dir)
        try:
            dcp.load_state_dict(pyt_state_dict, reader, planner=planner)
        except CheckpointException as exc:
            unsafe = unsafe_cause(exc, str(checkpoint_dir))
            if unsafe is not None:
                raise UnsafeCheckpointError(str(unsafe)) from None
            raise
        self.cached_global_metadata = reader.read_metadata()
        mcore_state_dict = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        mcore_state_dict = mcore_torch._replace_sharded_keys_with_state_dict_keys(
            mcore_state_dict, flat_mapping, rename_mapping)
        mcore_torch._restore_dict_types(mcore_state_dict, orig_sharded_state_dict)
        return mcore_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Any = None):
        """Megatron's ``load_tensors_metadata`` on the checked ``.metadata``."""
        if metadata is None:
            metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """{key: tensor or object without data} of the checkpoint, from the checked ``.metadata``."""
        metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        objects = {}
        for key, item in metadata.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                objects[obj.unique_key] = obj
        objects.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return objects


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """Megatron's common-state strategy with ``common.pt`` read by ``torch.load(weights_only=True)``.

    Passing ``weights_only`` explicitly keeps it even under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``.
    (Its per-object ``.pt`` loading is never used: ``SafeTorchDistLoadStrategy`` reads sharded objects.)
    """

    def load_common(self, checkpoint_dir: str | Path) -> StateDict:
        """The common (non-sharded) state dict of the checkpoint in ``checkpoint_dir``."""
        path = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
        if not os.path.isfile(path):
            raise CheckpointingException(f"Common file {path} does not exist")
        return weights_only_load(path, path)


def safe_load_strategies() -> tuple[SafeTorchDistLoadStrategy, SafeCommonLoadStrategy]:
    """``(sharded_strategy, common_strategy)`` for ``dist_checkpointing.load`` / ``load_sharded_metadata``."""
    return SafeTorchDistLoadStrategy(), SafeCommonLoadStrategy()
