"""The process groups of the model replica that generates: read from the model itself.

Every Megatron-Core model keeps the ``ProcessGroupCollection`` it was built with
(``LanguageModule.pg_collection``): the training layout's groups (``parallel_state``) for the
policy, or the decode layout's for the inference-only copy (``rollout/decode_layout.py``). The
generator takes its tensor-, pipeline- and expert-parallel groups from there, never from
``parallel_state``, so one code path decodes at either layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ReplicaGroups:
    """This rank's place in its model replica.

    Attributes:
        tp: tensor-parallel group (None: this rank alone).
        pp: pipeline-parallel group (None: this rank alone).
        ep: expert-parallel group when EP > 1 (the generator's lockstep), else None.
        mp: the replica's model-parallel group (TP x PP), whose ranks must admit the same requests.
        tp_size, pp_size: sizes of ``tp`` and ``pp``.
        tp_src: global rank of TP rank 0 of this rank's TP group.
        pp_ranks: global ranks of this rank's pipeline, first stage first.
    """

    tp: Optional[dist.ProcessGroup]
    pp: Optional[dist.ProcessGroup]
    ep: Optional[dist.ProcessGroup]
    mp: Optional[dist.ProcessGroup]
    tp_size: int
    pp_size: int
    tp_src: int
    pp_ranks: tuple[int, ...]

    @property
    def pp_index(self) -> int:
        return self.pp_ranks.index(_rank())

    @property
    def first(self) -> bool:
        return self.pp_index == 0

    @property
    def last(self) -> bool:
        return self.pp_index == self.pp_size - 1

    @property
    def prev(self) -> Optional[int]:
        return self.pp_ranks[self.pp_index - 1] if not self.first else None

    @property
    def next(self) -> Optional[int]:
        return self.pp_ranks[self.pp_index + 1] if not self.last else None

    def agree_min(self, values: list[int], device: torch.device) -> list[int]:
        """The element-wise minimum of ``values`` over the replica (every rank must size alike)."""
        out = torch.tensor(values, dtype=torch.int64, device=device)
        if self.mp is not None and dist.get_world_size(self.mp) > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MIN, group=self.mp)
        return [int(v) for v in out.tolist()]


def replica_groups(gpt: torch.nn.Module) -> ReplicaGroups:
    """The groups of the (unwrapped) ``GPTModel`` / ``MambaModel`` ``gpt`` (its ``pg_collection``)."""
    pgs = getattr(gpt, "pg_collection", None)
    if pgs is None or not dist.is_initialized():
        return ReplicaGroups(None, None, None, None, 1, 1, _rank(), (_rank(),))
    tp, pp = getattr(pgs, "tp", None), getattr(pgs, "pp", None)
    ep = getattr(pgs, "ep", None)
    tp_size = dist.get_world_size(tp) if tp is not None else 1
    pp_ranks = tuple(dist.get_process_group_ranks(pp)) if pp is not None else (_rank(),)
    return ReplicaGroups(tp=tp, pp=pp, ep=ep if ep is not None and dist.get_world_size(ep) > 1 else None,
                         mp=getattr(pgs, "mp", None), tp_size=tp_size, pp_size=len(pp_ranks),
                         tp_src=dist.get_global_rank(tp, 0) if tp_size > 1 else _rank(), pp_ranks=pp_ranks)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def model_parallel_source(group: Optional[dist.ProcessGroup]) -> tuple[bool, Optional[dist.ProcessGroup], int]:
    """(whether this rank is ``group``'s source, the group, the source's global rank): the one rank of
    a model replica that runs environments and rewards, then broadcasts to the others (its first rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return True, group, _rank()
    src = dist.get_global_rank(group, 0)
    return _rank() == src, group, src


@dataclass(frozen=True)
class GenerationReplica:
    """The model that generates, and this rank's place among the replicas that share the prompts.

    Attributes:
        module: this rank's model (the policy at the training layout, or its decode copy).
        dp_rank, dp_size, dp_group: the data-parallel replicas that split the prompts.
        mp_group: this replica's model-parallel group (its first rank runs environments and rewards).
        is_copy: a decode copy: prompts and results cross between the two layouts' replicas.
    """

    module: torch.nn.Module
    dp_rank: int
    dp_size: int
    dp_group: Optional[dist.ProcessGroup]
    mp_group: Optional[dist.ProcessGroup]
    is_copy: bool = False

    @classmethod
    def training(cls, module: torch.nn.Module) -> "GenerationReplica":
        """The policy itself at the training layout (Megatron's parallel state)."""
        from megatron.core import parallel_state as ps

        return cls(module, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                   ps.get_data_parallel_group(), ps.get_model_parallel_group())
