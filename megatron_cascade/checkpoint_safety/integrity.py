"""Durability and integrity of a checkpoint folder: fsync it whole, record every file's hash, find damage.

A checkpoint's record (``state.json``'s ``files`` for a training checkpoint, ``files.json`` for a
weights folder; written last) holds every other file's size and XXH3-128 hash. Hashing is shared out
as the writing is: a DCP shard ``__<rank>_<n>.distcp`` is hashed by the rank that wrote it (still in
its node's page cache), everything else by rank 0, each rank over a thread pool, and the shares are
gathered. ``damage`` compares a folder with its record: always sizes and the hashes of small files
(what any load parses first; cheap enough for a status check), and the hashes of the large files a
caller's share selects (a resume or a load verifies every byte, split over the ranks the same way).

XXH3-128 finds damage (a truncated copy, a flipped bit, garbage written into a shard) at ~20 GiB/s,
so reading the file back is the cost (SHA-256 ran at 1.5 GiB/s a core: 15-25% of a save here). It is
not a signature, and a cryptographic hash would not be one either: whoever can rewrite a shard can
rewrite the record beside it. Records of older checkpoints (SHA-256 of files up to 1 MiB) still verify.
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

import xxhash

# Files up to this size are hashed by every quick check (``damage`` without a share): the metadata.
QUICK_HASH_MAX_BYTES = 1 << 20
_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")  # DCP's per-rank storage prefix (Megatron's torch_dist too)
_HASH_THREADS = 8
HASH = "xxh3_128"  # the record's key for a file's hash (hex)
_HASHES: dict[str, Callable[[], "hashlib._Hash"]] = {HASH: xxhash.xxh3_128, "sha256": hashlib.sha256}
_READ_BYTES = 1 << 22


def fsync_path(path: str) -> None:
    """Flush ``path`` (a file or a folder: its entries) to stable storage.

    Linux flushes an inode's dirty pages whatever process wrote them, so a read-only descriptor
    suffices: the caller need not be the writer (on one node).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under ``root``, then every folder bottom-up (entries after their files)."""
    for folder, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def hash_file(path: str, algorithm: str = HASH) -> str:
    """The hash (hex) of the file at ``path`` by ``algorithm`` (a key of a record entry), streamed."""
    digest = _HASHES[algorithm]()
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                return digest.hexdigest()
            digest.update(view[:n])


def files_under(root: str) -> list[str]:
    """Every file under ``root``, as sorted paths relative to it."""
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, _, names in os.walk(root) for name in names)


def owner_rank(rel: str, world_size: int) -> int:
    """The rank that hashes ``rel`` at save and verifies it at load: the writer of a DCP shard (its rank
    modulo ``world_size``, which may differ at load), rank 0 for every other file."""
    match = _SHARD.search(os.path.basename(rel))
    return int(match.group(1)) % world_size if match else 0


def hash_files(root: str, rels: Iterable[str], algorithms: Optional[dict[str, str]] = None) -> dict[str, dict]:
    """``{rel: {"bytes": n, <algorithm>: hex}}`` for the files ``rels`` under ``root``, hashed in parallel
    (``algorithms``: {rel: algorithm} where not ``HASH``)."""
    rels = list(rels)

    def entry(rel: str) -> dict:
        path = os.path.join(root, rel)
        algorithm = (algorithms or {}).get(rel, HASH)
        return {"bytes": os.path.getsize(path), algorithm: hash_file(path, algorithm)}

    with ThreadPoolExecutor(max_workers=max(1, min(len(rels), os.cpu_count() or 1, _HASH_THREADS))) as pool:
        return dict(zip(rels, pool.map(entry, rels)))


def record_share(root: str, rank: int = 0, world_size: int = 1) -> dict[str, dict]:
    """This rank's share of a folder's record (``file_record``'s entries of the files it owns)."""
    return hash_files(root, [rel for rel in files_under(root) if owner_rank(rel, world_size) == rank])


def merge_shares(root: str, shares: list[dict[str, dict]]) -> dict[str, dict]:
    """The record of ``root`` from every rank's share; a file no share holds (a rank that could not see
    it yet on a lagging file system) is hashed here."""
    record = {rel: entry for share in shares for rel, entry in share.items()}
    missing = [rel for rel in files_under(root) if rel not in record]
    return dict(sorted({**record, **hash_files(root, missing)}.items()))


def file_record(root: str) -> dict[str, dict]:
    """``{relative path: {"bytes": n, "xxh3_128": hex}}`` for every file under ``root`` (one process)."""
    return record_share(root)


def check_record(record: object) -> dict[str, dict]:
    """``record`` if it has a record's shape (``{file: {"bytes": int, <hash>: hex}}``), else ``ValueError``."""
    if not isinstance(record, dict) or not all(
            isinstance(rel, str) and isinstance(e, dict) and type(e.get("bytes")) is int
            and all(isinstance(e.get(a, ""), str) for a in _HASHES) for rel, e in record.items()):
        raise ValueError("its file record is not a {file: {bytes, hash}} object")
    return record


def damage(root: str, record: Optional[dict], verify: Callable[[str], bool] = lambda rel: False) -> Optional[str]:
    """Why the files under ``root`` do not match ``record`` (first problem found), or None.

    Checks every recorded file's existence and size and the hash of each small one; the hash of a
    large file only where ``verify(rel)`` (a rank's share of a full verification). ``record`` None
    (a checkpoint written before records existed) cannot be checked: None.
    """
    hashed: dict[str, str] = {}
    for rel, entry in sorted((record or {}).items()):
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            return f"{rel}: {size} bytes, {entry['bytes']} written"
        algorithm = next((a for a in _HASHES if a in entry), None)
        if algorithm and (size <= QUICK_HASH_MAX_BYTES or verify(rel)):
            hashed[rel] = algorithm
    for rel, entry in hash_files(root, hashed, hashed).items():
        if entry[hashed[rel]] != record[rel][hashed[rel]]:
            return f"{rel}: content differs from what was written ({hashed[rel]})"
    return None
