"""What megatron-core 0.16.1's in-memory resharding planner (``megatron.core.resharding.planner``)
leaves out for our models, patched in one place (``patch_resharding``, idempotent):

* **Local-spec expert names.** Parameters of the local MoE spec (``SequentialMLP``,
  ``...experts.local_experts.<K>...``) keep their local expert index in the planner's names (only
  the grouped-GEMM ``weight<K>`` names are globalised): every EP rank's expert K would be one
  replicated parameter (experts 2, 3 received experts 0, 1). They get their global index and the
  expert data-parallel group as replicas (``../shared/notes/resharding_refit.md``).
* **Parameters of several TP-split parts.** A Mamba mixer's ``in_proj.weight`` is
  ``[z, x, B, C, dt]`` and its ``conv1d`` weight and bias ``[x, B, C]`` along dim 0, each part split
  over TP on its own (rank r holds ``[z_r, x_r, B_r, C_r, dt_r]``); the planner cuts the tensor as one
  (a TP=2 -> TP=1 refit gave ``[z_0, x_0, ..., z_1, x_1, ...]``: wrong tokens). Parameters tagged by
  ``tag_tp_parts`` are planned part by part, each with the planner's own TP tiling.
* **Tied output weights of a later pipeline stage.** With tied embeddings and PP > 1 the last stage
  holds its own ``output_layer.weight``, equal to the first stage's input embedding (Megatron keeps
  the two in step). A policy without PP has no such parameter: the planner found no source for the
  decode copy's ("Destination parameter 'output_layer.weight' ... not found"). Parameters tagged by
  ``tag_tied_output`` are planned as the embedding they equal.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.distributed as dist

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_PARTS_ATTR = "_megatron_cascade_tp_parts"
_TIED_ATTR = "_megatron_cascade_tied_output"
_EMBEDDING = "embedding.word_embeddings.weight"


def patch_resharding() -> None:
    """Install the planner patches (see the module docstring); a no-op when already installed."""
    from megatron.core.resharding import planner

    if getattr(planner.extract_param_metadata, "_megatron_cascade", False):
        return
    planner.extract_param_metadata = _extract_param_metadata(planner.extract_param_metadata)
    planner._determine_source_ranks_for_dst_param = _plan_by_parts(planner._determine_source_ranks_for_dst_param)


def tag_tp_parts(module: torch.nn.Module) -> None:
    """Mark the parameters of ``module``'s Mamba mixers that hold several TP-split parts with the
    parts' global sizes along dim 0 (what ``MambaMixer.sharded_state_dict`` splits them into)."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    for mixer in module.modules():
        if not isinstance(mixer, MambaMixer):
            continue
        bc = mixer.ngroups * mixer.d_state
        setattr(mixer.in_proj.weight, _PARTS_ATTR, (mixer.d_inner, mixer.d_inner, bc, bc, mixer.nheads))
        for param in (mixer.conv1d.weight, mixer.conv1d.bias):
            if param is not None:
                setattr(param, _PARTS_ATTR, (mixer.d_inner, bc, bc))


def tag_tied_output(module: torch.nn.Module) -> None:
    """Mark the output weight of a pipeline stage that computes the output without holding the input
    embedding, with tied embeddings: it is planned as the embedding (see the module docstring)."""
    if (getattr(module, "share_embeddings_and_output_weights", False) and getattr(module, "post_process", False)
            and not getattr(module, "pre_process", True) and module.output_layer.weight is not None):
        setattr(module.output_layer.weight, _TIED_ATTR, True)


def _extract_param_metadata(original):
    def extract_param_metadata(param, param_name, owner_rank, pg_collection, num_experts=None,
                               layer_module_prefix_map=None):
        meta = original(param, param_name, owner_rank, pg_collection, num_experts=num_experts,
                        layer_module_prefix_map=layer_module_prefix_map)
        meta.tp_parts = getattr(param, _PARTS_ATTR, None)  # gathered with the metadata (pickled)
        if getattr(param, _TIED_ATTR, False):
            meta.resolved_name = _EMBEDDING
        if not meta.is_ep:
            return meta
        expt_dp = getattr(pg_collection, "expt_dp", None)
        if expt_dp is not None:
            meta.data_parallel_group_ranks = dist.get_process_group_ranks(expt_dp)
        match = _LOCAL_EXPERT.search(meta.resolved_name or param_name)
        if match and num_experts:
            ep_ranks = meta.expert_parallel_group_ranks
            index = ep_ranks.index(owner_rank) * (num_experts // len(ep_ranks)) + int(match.group(1))
            meta.global_expert_index = index
            meta.resolved_name = _LOCAL_EXPERT.sub(f".local_experts.{index}.", meta.resolved_name or param_name, 1)
        return meta

    extract_param_metadata._megatron_cascade = True
    return extract_param_metadata


def _plan_by_parts(original):
    def determine_source_ranks(param_name, src_metadata, dst_metadata, my_global_rank):
        parts = getattr(dst_metadata, "tp_parts", None)
        if not parts or not (src_metadata.is_tp or dst_metadata.is_tp):
            return original(param_name, src_metadata, dst_metadata, my_global_rank)
        if getattr(src_metadata, "tp_parts", None) != parts or src_metadata.partition_dim != 0:
            raise RuntimeError(f"{param_name}: TP parts {getattr(src_metadata, 'tp_parts', None)} (source) vs "
                               f"{parts} (destination) along dim {src_metadata.partition_dim}")
        src_world = len(src_metadata.tensor_parallel_group_ranks) if src_metadata.is_tp else 1
        dst_world = len(dst_metadata.tensor_parallel_group_ranks) if dst_metadata.is_tp else 1
        ops, src_offset, dst_offset = [], 0, 0
        for size in parts:
            if size % src_world or size % dst_world:
                raise RuntimeError(f"{param_name}: a part of {size} rows does not split over TP {src_world} / {dst_world}")
            src_rows, dst_rows = size // src_world, size // dst_world
            for rank, src_slice, dst_slice in original(param_name, _part(src_metadata, src_rows),
                                                       _part(dst_metadata, dst_rows), my_global_rank):
                ops.append((rank, _shift(src_slice, src_offset, src_rows), _shift(dst_slice, dst_offset, dst_rows)))
            src_offset += src_rows
            dst_offset += dst_rows
        return ops

    return determine_source_ranks


def _part(meta, rows: int):
    """``meta`` as if the parameter were one part of ``rows`` local rows (dim 0)."""
    part = copy.copy(meta)
    part.shape = (rows, *tuple(meta.shape)[1:])
    part.tp_parts = None
    return part


def _shift(slices: tuple, offset: int, rows: int) -> tuple:
    """``slices`` of a part of ``rows`` rows (dim 0) as slices of the whole local tensor, where the
    part starts at row ``offset``."""
    first = slices[0]
    start = first.start or 0
    stop = rows if first.stop is None else first.stop
    return (slice(offset + start, offset + stop), *slices[1:])
