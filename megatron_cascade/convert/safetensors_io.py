"""Streaming safetensors I/O: read one tensor at a time, write size-capped shards with an index.

The reader parses each file's header itself (8-byte little-endian length + JSON) and reads a tensor
with one ``seek`` + ``readinto``: memory holds only the tensors asked for, never a whole file.
Missing shards and truncated files are reported with the file named, before any tensor is read.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from megatron_cascade.convert.errors import ConversionError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: ``file``, byte range [start, end) from the file start, dtype and shape."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate the header of one safetensors file: {tensor name: TensorInfo}.

    Raises ``ConversionError`` naming ``path`` if it is missing, not safetensors, or truncated.
    """
    if not os.path.isfile(path):
        raise ConversionError(f"safetensors file {path} does not exist; re-download or re-export the checkpoint")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path} is truncated ({size} bytes): no safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ConversionError(f"{path} is truncated or not safetensors: header of {header_len} bytes, "
                                  f"file of {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConversionError(f"{path} has a corrupt safetensors header: {exc}") from exc
    base = 8 + header_len
    infos = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        infos[name] = TensorInfo(name, path, meta["dtype"], tuple(meta["shape"]), base + start, base + end)
    data_end = max((i.end for i in infos.values()), default=base)
    if data_end > size:
        raise ConversionError(f"{path} is truncated: its header needs {data_end} bytes, the file has {size}; "
                              "re-download or re-export it")
    return infos


class SafetensorsReader:
    """All tensors of an HF checkpoint directory (single file or sharded with an index), read lazily."""

    def __init__(self, directory: str):
        self.directory = directory
        self.tensors: dict[str, TensorInfo] = {}
        for path in self._files():
            self.tensors.update(read_header(path))

    def _files(self) -> list[str]:
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
            for name in files:
                if not os.path.isfile(os.path.join(self.directory, name)):
                    raise ConversionError(f"{index} names shard {name}, which is missing from {self.directory}; "
                                          "download every shard the index lists")
            return [os.path.join(self.directory, name) for name in files]
        single = os.path.join(self.directory, SINGLE_FILE)
        if os.path.isfile(single):
            return [single]
        raise ConversionError(f"{self.directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` read from disk (a fresh CPU tensor in the stored dtype)."""
        info = self.tensors.get(name)
        if info is None:
            raise ConversionError(f"tensor {name} is not in the checkpoint {self.directory}")
        buf = bytearray(info.end - info.start)
        with open(info.file, "rb") as f:
            f.seek(info.start)
            if f.readinto(buf) != len(buf):
                raise ConversionError(f"{info.file} is truncated: could not read tensor {name}")
        dtype = DTYPES[info.dtype]
        if not buf:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)

    def total_parameters(self) -> int:
        """Number of scalars over all tensors."""
        total = 0
        for info in self.tensors.values():
            n = 1
            for d in info.shape:
                n *= d
            total += n
        return total


def parse_size(text: str | int) -> int:
    """Bytes in '5GB', '500MB', '2GiB', '1024' (decimal units, as HF uses; *iB binary)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


class ShardedSafetensorsWriter:
    """Writes tensors into ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_bytes``.

    Holds at most one shard in memory. One shard is written as ``model.safetensors`` without an
    index, several with ``model.safetensors.index.json`` (the Hugging Face convention).
    """

    def __init__(self, directory: str, max_shard_bytes: int):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total_bytes = 0
        os.makedirs(directory, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` under ``name``; flushes the current shard first if it would overflow."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self._total_bytes += nbytes

    def _flush(self) -> None:
        path = os.path.join(self.directory, f".shard-{len(self._shards):05d}.tmp")
        save_file(self._pending, path, metadata={"format": "pt"})
        self._shards.append(sorted(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, name the shards and write the index; returns the shard file names."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for i, name in enumerate(names):
            os.replace(os.path.join(self.directory, f".shard-{i:05d}.tmp"), os.path.join(self.directory, name))
        if count > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self._shards) for t in shard}
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
        return names
