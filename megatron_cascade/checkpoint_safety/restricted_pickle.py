"""Unpickling that constructs only allow-listed classes: a hostile pickle is refused, never run.

A pickle can name any importable callable (``os.system``, ``builtins.exec``) and call it while it is
read. ``restricted_loads`` resolves every global through an allow-list of pure data classes and
lookup functions, so a pickle naming anything else is refused with ``UnsafeCheckpointError`` before
anything is called. Every length field inside the pickle is checked against the data before the C
unpickler (which allocates what a length says before reading) sees it. ``weights_only_load`` is
``torch.load(weights_only=True)`` with torch's refusal turned into the same error.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
import pickletools
from typing import Any, Callable, Iterable

import torch

# Refuse metadata files larger than this (bytes): a DCP ``.metadata`` is a few MB even for 100B-parameter
# models at thousands of ranks; a multi-GB one is not a checkpoint we wrote.
MAX_PICKLE_BYTES = 1 << 30


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file would run code when read, or is not what it claims to be; the message names it."""


# ``getattr`` as a pickle names it (``__builtin__`` in protocols 0-2): resolved to a lookup of an Enum member only.
_GETATTR = frozenset({("builtins", "getattr"), ("__builtin__", "getattr")})


class _AllowListUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals come only from ``allowed`` (else ``UnsafeCheckpointError``)."""

    def __init__(self, data: bytes, allowed: Callable[[str, str], Any], path: str):
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _GETATTR:
            return self._enum_member
        obj = self._allowed(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"{self._path} is not plain data: its pickle asks to load {module}.{name}, which is not allowed "
                "(it could run code); refusing to read it. Re-create the checkpoint with megatron-cascade or take "
                "it from a source you trust")
        return obj

    def _enum_member(self, cls: Any, name: Any) -> Any:
        """``getattr(cls, name)`` for exactly a member of an allow-listed Enum: how Python 3.11.0-3.11.4
        (Debian 12's 3.11.2) pickles an Enum member; other versions call the class with the value."""
        if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
            return cls[name]
        raise UnsafeCheckpointError(
            f"{self._path} is not plain data: its pickle asks for getattr({cls!r}, {name!r}); only a member of an "
            "allowed Enum may be looked up this way. Refusing to read it")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._path}: unexpected persistent id {pid!r} in a metadata pickle")


def read_limited(path: str, limit: int = MAX_PICKLE_BYTES) -> bytes:
    """The bytes of ``path``; ``UnsafeCheckpointError`` if it is larger than ``limit`` bytes."""
    size = os.path.getsize(path)
    if size > limit:
        raise UnsafeCheckpointError(f"{path} is {size} bytes, more than the {limit} a metadata file may have")
    with open(path, "rb") as f:
        return f.read(limit + 1)


def restricted_loads(data: bytes, allowed: Callable[[str, str], Any], path: str) -> Any:
    """Unpickle ``data`` (read from ``path``, named in errors) resolving globals only via ``allowed``.

    ``allowed(module, name)`` returns the object to use for that global, or None to refuse it.
    Raises ``UnsafeCheckpointError`` for a refused global and for any malformed pickle.
    """
    try:
        # The C unpickler allocates a counted bytes/str opcode's length before reading it (a forged 8-byte
        # length asks for up to 16 EiB); pickletools checks every length against the data first.
        for _ in pickletools.genops(data):
            pass
        return _AllowListUnpickler(data, allowed, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure (RecursionError, MemoryError too) means a corrupt file
        raise UnsafeCheckpointError(f"{path} is not a readable checkpoint pickle "
                                    f"({type(exc).__name__}: {exc}); re-copy the checkpoint") from exc


def allow_list(entries: Iterable[tuple[str, str]]) -> Callable[[str, str], Any]:
    """An ``allowed`` function for exactly the globals ``(module, name)`` in ``entries`` (imported on demand)."""
    import importlib

    table = frozenset(entries)

    def allowed(module: str, name: str) -> Any:
        if (module, name) not in table:
            return None
        return getattr(importlib.import_module(module), name)

    return allowed


def weights_only_load(source: Any, what: str) -> Any:
    """``torch.load(source, weights_only=True)`` on CPU; ``UnsafeCheckpointError`` naming ``what`` if refused."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{what} is not plain data (tensors, numbers, strings, containers): {refusal_reason(exc)}; "
            "refusing to unpickle it (it could run code). Re-create the checkpoint with megatron-cascade or take "
            "it from a source you trust") from None


def refusal_reason(exc: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only refusal that names the global (its message is mostly boilerplate)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "WeightsUnpickler" in line]
    return (named or lines or [type(exc).__name__])[0]
