"""``reshard``: a validated copy of a distributed checkpoint for a target TP/PP/EP layout.

Megatron ``torch_dist`` checkpoints do not depend on the layout they were saved at: any TP/PP/EP
layout loads them (each rank reads the overlap of its shards with the stored chunks). So there is
nothing to re-slice; ``reshard`` checks that the model fits the target layout, reads every tensor
(catching missing or truncated files) and writes a fresh checkpoint with the HF side files.
"""

from __future__ import annotations

import os

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.convert.dist_copy import copy_dist_checkpoint
from megatron_cascade.convert.hf_files import HF_SUBDIR, copy_directory_files
from megatron_cascade.convert.layout import validate_layout
from megatron_cascade.convert.megatron_to_hf import load_model_config
from megatron_cascade.model.weights_checkpoint import write_file_record


def reshard(ckpt_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1, ep: int = 1) -> ModelConfig:
    """Copy the checkpoint in ``ckpt_dir`` to ``out_dir`` after validating the layout ``tp``/``pp``/``ep``.

    Returns the checkpoint's model config. The copy loads at the target layout (and at any other).
    """
    model = load_model_config(ckpt_dir)
    validate_layout(model, tp, pp, ep)
    copy_dist_checkpoint(ckpt_dir, out_dir, model)
    hf_side = os.path.join(ckpt_dir, HF_SUBDIR)
    if os.path.isdir(hf_side):
        copy_directory_files(hf_side, os.path.join(out_dir, HF_SUBDIR))  # regular files inside the checkpoint only
    write_file_record(out_dir)  # every load verifies each byte against it
    return model
