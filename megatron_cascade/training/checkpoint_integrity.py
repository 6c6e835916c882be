"""Durability and integrity of a checkpoint folder: fsync it whole, record its files, find damage.

A checkpoint's ``state.json`` (written last) records every other file's size, and the SHA-256 of the
small ones (Megatron's ``.metadata`` / ``common.pt`` / ``metadata.json``, our RNG states, the model
config), which is what any load parses first. ``damage`` compares a folder with that record: a
truncated, missing or rewritten file is found without reading the tensor data. Not found: a flipped
bit inside a large tensor file of unchanged size (hashing every tensor would read the whole
checkpoint back after each save and at each resume).
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

# Files up to this size are hashed: every metadata file, never the tensor shards of a real model.
HASH_MAX_BYTES = 1 << 20


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


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(root: str) -> dict[str, dict]:
    """``{relative path: {"bytes": n[, "sha256": hex]}}`` for every file under ``root``."""
    record = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            size = os.path.getsize(path)
            entry: dict = {"bytes": size}
            if size <= HASH_MAX_BYTES:
                entry["sha256"] = _sha256(path)
            record[os.path.relpath(path, root)] = entry
    return record


def damage(root: str, record: Optional[dict]) -> Optional[str]:
    """Why the files under ``root`` do not match ``record`` (first problem found), or None.

    ``record`` None (a checkpoint written before records existed) cannot be checked: None.
    """
    for rel, entry in sorted((record or {}).items()):
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            return f"{rel}: {size} bytes, {entry['bytes']} written"
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{rel}: content differs from what was written (SHA-256)"
    return None
