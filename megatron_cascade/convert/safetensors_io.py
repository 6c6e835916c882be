"""Streaming safetensors I/O: read one tensor at a time, write size-capped shards with an index.

The reader parses each file's header itself (8-byte little-endian length + JSON) and reads a tensor
with one ``seek`` + ``readinto``: memory holds only the tensors asked for, never a whole file.
Missing shards, truncated files and forged headers (lengths, dtypes, spans that do not add up) are
reported with the file named, before any tensor is read or any buffer sized from the header.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from megatron_cascade.models.errors import ConversionError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# The safetensors format's own limit on the JSON header (bytes); a larger one is forged.
MAX_HEADER_BYTES = 100_000_000
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

    Checked before anything is allocated from it: the header length against the file size (and
    ``MAX_HEADER_BYTES``), the JSON (an object, no repeated names), each tensor's dtype (known),
    shape (non-negative ints), byte span (``shape`` x dtype size bytes, inside the data section, not
    overlapping another). Raises ``ConversionError`` naming ``path`` (and the tensor) otherwise.
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
        if header_len > MAX_HEADER_BYTES:
            raise ConversionError(f"{path} is not a valid safetensors file: header of {header_len} bytes, "
                                  f"more than the format's limit of {MAX_HEADER_BYTES}")
        raw = f.read(header_len)
    header = _parse_header_json(raw, path)
    infos = {name: _tensor_info(name, meta, path, 8 + header_len, size)
             for name, meta in header.items() if name != "__metadata__"}
    if not isinstance(header.get("__metadata__", {}), dict):
        raise ConversionError(f"{path} has a corrupt safetensors header: __metadata__ is not an object")
    _check_no_overlap(infos, path)
    return infos


def _parse_header_json(raw: bytes, path: str) -> dict:
    def no_repeats(pairs: list[tuple[str, object]]) -> dict:
        repeated = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        if repeated:
            raise ConversionError(f"{path} has a corrupt safetensors header: {repeated[:3]} listed twice")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_repeats)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConversionError(f"{path} has a corrupt safetensors header: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path} has a corrupt safetensors header: a JSON {type(header).__name__}, "
                              "not an object")
    return header


def _tensor_info(name: str, meta: object, path: str, base: int, size: int) -> TensorInfo:
    """The validated ``TensorInfo`` of header entry ``name`` (data section from byte ``base`` to ``size``)."""
    def bad(problem: str) -> ConversionError:
        return ConversionError(f"{path} has a corrupt safetensors header: tensor {name!r} {problem}; "
                               "re-download or re-export the checkpoint")

    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
        raise bad("lacks dtype, shape or data_offsets")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"has unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative ints")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    start, end = offsets
    need = math.prod(shape) * DTYPES[dtype].itemsize
    if end - start != need:
        raise bad(f"spans {end - start} bytes, its shape {shape} of {dtype} needs {need}")
    if base + end > size:
        raise ConversionError(f"{path} is truncated: tensor {name!r} needs bytes up to {base + end}, the file has "
                              f"{size}; re-download or re-export it")
    return TensorInfo(name, path, dtype, tuple(shape), base + start, base + end)


def _check_no_overlap(infos: dict[str, TensorInfo], path: str) -> None:
    spans = sorted((i.start, i.end, i.name) for i in infos.values() if i.end > i.start)
    for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
        if start < end:
            raise ConversionError(f"{path} has a corrupt safetensors header: tensors {before!r} and {after!r} "
                                  "share bytes; re-download or re-export the checkpoint")


def _read_weight_map(index: str) -> dict[str, str]:
    """{tensor: shard file name} of ``model.safetensors.index.json``; shards must lie in its directory."""
    try:
        with open(index, "rb") as f:
            weight_map = json.loads(f.read().decode("utf-8")).get("weight_map", {})
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, RecursionError) as exc:
        raise ConversionError(f"{index} is not a valid safetensors index ({type(exc).__name__}: {exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(f"{index}: weight_map is not an object of tensor name -> shard file name")
    for name in set(weight_map.values()):
        if name in ("", ".", "..") or os.path.basename(name) != name or "\\" in name:
            raise ConversionError(f"{index} names shard {name!r}, which is not a file name inside "
                                  f"{os.path.dirname(index)}; shards must lie next to the index")
    return weight_map


class SafetensorsReader:
    """All tensors of an HF checkpoint directory (single file or sharded with an index), read lazily."""

    def __init__(self, directory: str):
        self.directory = directory
        self.tensors: dict[str, TensorInfo] = {}
        for path in self._files():
            infos = read_header(path)
            twice = sorted(set(infos) & set(self.tensors))
            if twice:
                raise ConversionError(f"tensor {twice[0]!r} is in both {self.tensors[twice[0]].file} and {path}; "
                                      "the checkpoint mixes two exports: re-download it")
            self.tensors.update(infos)

    def _files(self) -> list[str]:
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.isfile(index):
            files = sorted(set(_read_weight_map(index).values()))
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
