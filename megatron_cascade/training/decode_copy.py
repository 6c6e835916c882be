"""The policy's decode copy: an inference-only model at the decode layout (``rollout.parallel``), on
its own process groups, refit from the training model in memory after every optimizer step.

Training keeps the layout memory needs (PP, CP, SP); decoding wants none of it: pipeline stages
decode in series and context parallelism cannot decode one token per request. The copy holds the
same weights at another layout (typically TP=1 or 2, no PP, EP as training; PP only for weights too
large for TP x EP alone), built in the policy's
precision, and generation runs on it (``rollout/`` reads the groups from the model). Refit is
megatron-core's ``megatron.core.resharding.swap_model_weights`` (a plan built once, then point to
point copies: gloo on CPU, NCCL on GPU), never a checkpoint on disk, plus what it leaves out:

* the planner's names of local-spec experts, its cut of a Mamba mixer's multi-part parameters and
  the source of a later pipeline stage's tied output weight (``training/reshard_patches.py``);
* persistent buffers (the router's ``expert_bias``) are not copied by megatron-core: copied here;
* dtypes are not compared by megatron-core (a bf16 policy into an fp32 copy gave NaN logits):
  refused here before the first refit;
* the distributed optimizer with ``overlap_param_gather`` leaves other ranks' shards stale until
  the next forward: ``finish_param_sync`` first.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_cascade.config import ModelConfig
from megatron_cascade.config.model import DecodeParallelConfig
from megatron_cascade.model import build_model, resolve_layout
from megatron_cascade.model.parallel import Layout, build_decode_process_groups
from megatron_cascade.rollout.cuda_graphs import graph_decode_steps_only
from megatron_cascade.rollout.replica_groups import GenerationReplica
from megatron_cascade.training.policy import Policy, finish_param_sync, in_model_precision, unwrap
from megatron_cascade.training.reshard_patches import patch_resharding, tag_tied_output, tag_tp_parts

class DecodeCopy:
    """The inference-only copy of the policy at ``decode``'s layout; collective to build and refit.

    Attributes:
        layout: the decode layout (its DP size is what the world leaves after TP).
        module: this rank's model (eval mode, no gradients), its ``pg_collection`` the decode groups.
        refit_seconds: wall time of the last refit.
        refit_bytes: parameter bytes this rank received in one refit (its share of the copy).
        graphed_layers: layers that replay CUDA graphs in decode steps (``rollout.cuda_graphs`` on a
            GPU; ``rollout/cuda_graphs.py``), 0 otherwise.
    """

    def __init__(self, model_cfg: ModelConfig, decode: DecodeParallelConfig, *,
                 timeout_minutes: Optional[float] = None, cuda_graphs: bool = False) -> None:
        patch_resharding()
        parallel = decode.as_parallel()
        self.layout: Layout = resolve_layout(model_cfg, parallel, dist.get_world_size(), check_this_machine=False,
                                             prefix="rollout.parallel.")
        self.groups = build_decode_process_groups(self.layout, timeout_minutes)
        # Graph managers need CUDA; on CPU the context still pads decode steps to the graph sizes.
        graphs = cuda_graphs and torch.cuda.is_available()
        model = build_model(model_cfg, parallel, pg_collection=self.groups, inference_cuda_graphs=graphs)
        self.graphed_layers = graph_decode_steps_only(model) if graphs else 0
        self.module = in_model_precision(model, model_cfg).eval()
        for param in self.module.parameters():
            param.requires_grad_(False)
        self.refit_seconds = 0.0
        self.refit_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        self._shapes = [p.shape for p in self.module.parameters()]
        self._checked = False

    def release(self) -> None:
        """Free the copy's weights until the next refit (training needs the memory in between; the
        refit plan keeps slices, not tensors). Buffers stay: they are small."""
        for param in self.module.parameters():
            param.data = param.data.new_empty(0)

    def _materialize(self) -> None:
        for param, shape in zip(self.module.parameters(), self._shapes):
            if param.data.shape != shape:
                param.data = param.data.new_empty(shape)

    @property
    def replica(self) -> GenerationReplica:
        """The copy as the generator of its data-parallel replica."""
        return GenerationReplica(self.module, self.dp_rank, self.dp_size, self.groups.dp, self.groups.mp, is_copy=True)

    @property
    def dp_rank(self) -> int:
        """This rank's decode replica (0 .. DP - 1)."""
        return dist.get_rank(self.groups.dp)

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    def refit(self, policy: Policy) -> None:
        """Copy the policy's current weights (and persistent buffers) into the copy; collective over
        the whole job. Seconds in ``refit_seconds``."""
        from megatron.core.resharding import swap_model_weights

        start = time.perf_counter()
        self._materialize()
        finish_param_sync(policy)
        source = policy.module
        if not self._checked:
            _check_dtypes(unwrap(source), unwrap(self.module))
            self._checked = True
        for module in (unwrap(source), unwrap(self.module)):  # before megatron-core plans (and caches) the copy
            tag_tp_parts(module)
        tag_tied_output(unwrap(self.module))
        with torch.no_grad():
            swap_model_weights(source, self.module, "nccl" if torch.cuda.is_available() else "gloo")
            _copy_persistent_buffers(unwrap(source), unwrap(self.module))
        self.refit_seconds = time.perf_counter() - start


def _check_dtypes(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """The copy's parameters are of the policy's dtypes (the resharding copy does not cast)."""
    policy, copy = ({str(p.dtype) for p in m.parameters()} for m in (source, target))
    if policy != copy:
        raise RuntimeError(f"the decode copy holds {sorted(copy)} parameters, the policy {sorted(policy)}: the copy "
                           "must be built in the policy's precision (model.precision)")


def _copy_persistent_buffers(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Persistent buffers (the MoE router's ``expert_bias``) of the policy into the copy, by global
    layer name. They are small and replicated: every rank shares its own, each takes what it holds."""
    mine = {_global_name(source, name): buf.detach().cpu() for name, buf in _persistent_buffers(source)}
    wanted = list(_persistent_buffers(target))
    if not wanted and not mine:
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {k: v for shard in everyone for k, v in shard.items()}
    for name, buf in wanted:
        key = _global_name(target, name)
        if key not in merged:
            raise RuntimeError(f"refit: the policy has no buffer {key} for the decode copy")
        buf.copy_(merged[key].to(buf.device))


def _persistent_buffers(module: torch.nn.Module):
    keys = set(module.state_dict(keep_vars=True))
    return [(name, buf) for name, buf in module.named_buffers() if name in keys and buf is not None]


def _global_name(module: torch.nn.Module, name: str) -> str:
    """``name`` with its layer index global (pipeline stages number their layers from 0)."""
    from megatron.core.resharding.utils import _build_layer_module_prefix_map, _resolve_global_layer_number_in_name

    cache = module.__dict__.setdefault("_mc_layer_prefix_map", _build_layer_module_prefix_map(module))
    return _resolve_global_layer_number_in_name(name, cache)
