"""Read whole (TP=1) tensors from a Megatron distributed checkpoint, a few at a time.

Each tensor is the region of its checkpoint key at the global offset Megatron gives it (its layer,
and expert, index on the stacked axes); a small DCP load planner reads exactly that region from
whatever chunks the checkpoint holds (any TP/PP/EP layout it was saved at). No model is built.
Keys are canonical (``model.spec_layout``); a checkpoint written with the local spec's names by an
earlier version is read under those.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from megatron_cascade.checkpoint_safety import UnsafeCheckpointError, read_dcp_metadata
from megatron_cascade.convert.dist_writer import METADATA_FILE, Piece, Placement, piece_state_key, pieces_of
from megatron_cascade.models.errors import ConversionError
from megatron_cascade.convert.runtime import Skeleton
from megatron_cascade.model.spec_layout import legacy_key


def read_dist_metadata(ckpt_dir: str):
    """The DCP ``Metadata`` of a distributed checkpoint (keys, global shapes, dtypes); no tensor is read.

    Unpickled with an allow-list (``checkpoint_safety``): a ``.metadata`` that would run code, or is
    corrupt, raises ``ConversionError`` naming it.
    """
    path = os.path.join(ckpt_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise ConversionError(f"{ckpt_dir} is not a Megatron distributed checkpoint: {METADATA_FILE} missing")
    try:
        return read_dcp_metadata(ckpt_dir)
    except UnsafeCheckpointError as exc:
        raise ConversionError(str(exc)) from None


def _region_planner(placements: dict[str, Placement]):
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionLoadPlanner(DefaultLoadPlanner):
        """Loads ``state_dict[name]`` from the region ``placements[name]`` of its checkpoint key."""

        def create_local_plan(self) -> LoadPlan:
            items = []
            for name, tensor in self.state_dict.items():
                place = placements[name]
                chunk = ChunkStorageMetadata(offsets=torch.Size(place.offset), sizes=tensor.shape)
                md = self.metadata.state_dict_metadata[place.key]
                zero = MetadataIndex(name, torch.Size([0] * tensor.dim()))
                items += [replace(it, dest_index=zero) for it in create_read_items_for_chunk_list(place.key, md, [chunk])]
            return LoadPlan(items)

    return RegionLoadPlanner()


class DistCheckpointReader:
    """Whole tensors of ``skeleton`` from the distributed checkpoint in ``ckpt_dir``."""

    def __init__(self, ckpt_dir: str, skeleton: Skeleton):
        self.ckpt_dir = ckpt_dir
        self.skeleton = skeleton
        self.metadata = read_dist_metadata(ckpt_dir).state_dict_metadata
        # A tensor is stored as one or more row ranges (pieces), each under its own checkpoint key or chunk.
        self.pieces: dict[str, list[Piece]] = {
            name: [replace(p, placement=self._stored_placement(p.placement)) for p in pieces_of(entry)]
            for name, entry in skeleton.tensors.items()
        }
        self.placements = {piece_state_key(name, i): p.placement
                           for name, pieces in self.pieces.items() for i, p in enumerate(pieces)}
        self._check_keys()

    def _stored_placement(self, place: Placement) -> Placement:
        """``place``, under its legacy local-spec key if the checkpoint holds that instead of the canonical one."""
        old = legacy_key(place.key)
        if place.key not in self.metadata and old is not None and old in self.metadata:
            return replace(place, key=old)
        return place

    def _check_keys(self) -> None:
        for place in self.placements.values():
            item = self.metadata.get(place.key)
            if item is None or not hasattr(item, "chunks"):
                raise ConversionError(f"checkpoint {self.ckpt_dir} lacks tensor {place.key} that its model config "
                                      "needs; it was saved from another architecture or is incomplete")
            if tuple(item.size) != place.global_shape:
                raise ConversionError(f"checkpoint {self.ckpt_dir}: {place.key} has global shape "
                                      f"{tuple(item.size)}, the model config needs {place.global_shape}")

    def dtype_of(self, name: str) -> torch.dtype:
        """Stored dtype of tensor ``name``."""
        return self.metadata[self.pieces[name][0].placement.key].properties.dtype

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """{name: whole TP=1 tensor in its stored dtype} for the module names ``names``."""
        import torch.distributed.checkpoint as dcp

        from torch.distributed.checkpoint.api import CheckpointException

        from megatron_cascade.checkpoint_safety.megatron_load import SafeFileSystemReader, unsafe_cause

        state = {}
        for name in names:
            shape = self.skeleton.local_shape(name)
            for i, piece in enumerate(self.pieces[name]):
                stored = self.metadata[piece.placement.key].properties.dtype
                state[piece_state_key(name, i)] = torch.empty(
                    (1,) * piece.placement.prepend + (piece.length, *shape[1:]), dtype=stored)
        reader = SafeFileSystemReader(self.ckpt_dir)  # the allow-listed .metadata, spans checked against files
        try:
            reader.read_metadata()
        except UnsafeCheckpointError as exc:
            raise ConversionError(str(exc)) from None
        try:
            dcp.load(state, storage_reader=reader, planner=_region_planner(self.placements), no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised naming the directory
            unsafe = unsafe_cause(exc, self.ckpt_dir)
            if unsafe is not None:
                raise ConversionError(str(unsafe)) from None
            raise ConversionError(f"could not read {names[:3]} from {self.ckpt_dir}: {type(exc).__name__}: {exc}; "
                                  "a data file may be missing or truncated") from exc
        return {name: self._join(name, state) for name in names}

    def _join(self, name: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The whole tensor ``name`` from its pieces in ``state`` (in the first piece's dtype)."""
        shape = self.skeleton.local_shape(name)
        pieces = self.pieces[name]
        if len(pieces) == 1:
            return state[piece_state_key(name, 0)].reshape(shape)
        out = torch.empty(shape, dtype=self.dtype_of(name))
        for i, piece in enumerate(pieces):
            out.narrow(0, piece.start, piece.length).copy_(state[piece_state_key(name, i)].reshape(-1, *shape[1:]))
        return out
