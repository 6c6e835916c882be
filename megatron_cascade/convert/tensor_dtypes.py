"""The per-tensor dtypes of an imported Hugging Face checkpoint, kept for the way back.

Released 16-bit checkpoints keep a few tensors in float32 (Nemotron-H's router
``e_score_correction_bias``); a Megatron model also keeps some in float32 whatever its precision
(Mamba's ``A_log`` and ``D``, the router's expert bias). So that HF -> Megatron -> HF gives back
each tensor in the dtype it came in, ``hf_to_megatron`` records, in ``<ckpt>/hf/tensor_dtypes.json``,
the checkpoint's dtype and the HF tensors stored in another one, and ``megatron_to_hf`` (without
``--dtype``) writes each tensor in its recorded dtype. Checkpoints without a record (trained here)
export each tensor in the dtype it is stored in, which loses nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from megatron_cascade.models.errors import ConversionError
from megatron_cascade.convert.hf_files import HF_SUBDIR
from megatron_cascade.convert.safetensors_io import DTYPE_NAMES, DTYPES, SafetensorsReader

DTYPES_FILE = "tensor_dtypes.json"


@dataclass(frozen=True)
class DtypeRecord:
    """Dtypes of the HF tensors an import read: ``default``, but ``exceptions`` by name."""

    default: torch.dtype
    exceptions: dict[str, torch.dtype]

    def of(self, hf_name: str) -> torch.dtype:
        return self.exceptions.get(hf_name, self.default)


def write_source_dtypes(weights: SafetensorsReader, names: set[str], source: torch.dtype, default: torch.dtype,
                        ckpt_dir: str) -> None:
    """Record under ``ckpt_dir/hf/`` that the HF tensors ``names`` export as ``default`` (the converted
    precision), but those whose dtype in ``weights`` is not ``source`` (the HF config's dtype): as that one."""
    code = DTYPE_NAMES[default]
    exceptions = {n: weights.tensors[n].dtype for n in sorted(names) if weights.tensors[n].dtype != DTYPE_NAMES[source]}
    os.makedirs(os.path.join(ckpt_dir, HF_SUBDIR), exist_ok=True)
    with open(os.path.join(ckpt_dir, HF_SUBDIR, DTYPES_FILE), "w") as f:
        json.dump({"default": code, "exceptions": exceptions}, f, indent=1, sort_keys=True)


def read_source_dtypes(ckpt_dir: str) -> DtypeRecord | None:
    """The record an HF import wrote in ``ckpt_dir``, or None (not imported from HF, or written before records)."""
    path = os.path.join(ckpt_dir, HF_SUBDIR, DTYPES_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
        return DtypeRecord(DTYPES[raw["default"]], {str(n): DTYPES[c] for n, c in raw["exceptions"].items()})
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
        raise ConversionError(f"{path} is not a valid dtype record ({type(exc).__name__}: {exc}); delete it to "
                              "export every tensor in the dtype it is stored in") from exc
