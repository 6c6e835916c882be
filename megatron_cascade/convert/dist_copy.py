"""Copy a distributed checkpoint tensor by tensor (layer by layer) into a new one."""

from __future__ import annotations

from megatron_cascade.config.model import ModelConfig
from megatron_cascade.convert.dist_reader import DistCheckpointReader
from megatron_cascade.convert.dist_writer import DistCheckpointWriter
from megatron_cascade.convert.runtime import build_skeleton, megatron_runtime


def copy_dist_checkpoint(src_dir: str, out_dir: str, model: ModelConfig, *, src_prefix: str = "") -> None:
    """Read every tensor ``model`` needs from ``src_dir`` (keys prefixed ``src_prefix``) and write them,
    unprefixed, as a new checkpoint with ``model_config.json`` in ``out_dir``.

    Every tensor is read in full, so a missing or truncated data file fails here, naming ``src_dir``.
    Peak memory: one decoder layer.
    """
    with megatron_runtime():
        reader = DistCheckpointReader(src_dir, build_skeleton(model, prefix=src_prefix))
        target = build_skeleton(model)
        dtype = reader.dtype_of("embedding.word_embeddings.weight")
        writer = DistCheckpointWriter(out_dir, target, model, dtype)
        for name in target.global_names():
            writer.write(reader.read([name]))
        for layer in range(model.num_layers):
            writer.write(reader.read(target.layer_names(layer)))
        writer.finish()
