"""Parallel layout: validation against the model and the world size, and Megatron initialisation."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_cascade.config.model import ConfigError, ModelConfig, ParallelConfig
from megatron_cascade.models.architectures import megatron_architecture


def transformer_engine_available() -> bool:
    """Whether Transformer Engine's PyTorch side imports and a CUDA device is present (FP8, TE specs).

    ``import transformer_engine`` succeeds when only its core library is there; what Megatron-Core
    uses is ``transformer_engine.pytorch`` and its compiled extension, which a build against another
    torch (or CUDA) leaves unloadable. Such a TE counts as absent, with a warning naming the error
    (``megatron-cascade doctor`` shows it too)."""
    if not torch.cuda.is_available():
        return False
    return _transformer_engine_pytorch_problem() is None


@functools.cache
def _transformer_engine_pytorch_problem() -> Optional[str]:
    """Why ``transformer_engine.pytorch`` does not import here (None: it does; "absent": not installed)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "absent"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken extension raises ImportError, OSError, RuntimeError, ...
        problem = f"{type(exc).__name__}: {exc}"
        logging.getLogger(__name__).warning(
            "Transformer Engine is installed but transformer_engine.pytorch does not import (%s): the local "
            "layer spec runs instead (slower, no FP8); rebuild TE against this torch (scripts/install_gpu.sh "
            "--build) or run `megatron-cascade doctor`", problem)
        return problem
    return None


@dataclass(frozen=True)
class Layout:
    """Resolved sizes of every parallel dimension for one world size."""

    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    expert_dp: int


def resolve_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int, *,
                   check_this_machine: bool = True, prefix: str = "parallel.") -> Layout:
    """Check ``parallel`` against ``model`` and ``world_size``; raise ``ConfigError`` naming the key.

    ``check_this_machine=False`` skips the checks of what this machine can run (Transformer
    Engine, CUDA): a dry run plans for a cluster from a laptop.
    ``prefix``: where the sizes live in the config (``rollout.parallel.`` for a decode layout).
    Returns the resolved layout (data-parallel size is what the other sizes leave).
    """
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    ep = parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size or tp
    for key, value in [
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
    ]:
        if value < 1:
            raise ConfigError(f"{prefix}{key}={value} must be >= 1")
    _check_divides(f"{prefix}tensor_model_parallel_size", tp, "model.num_attention_heads", model.num_attention_heads)
    groups = model.num_query_groups or model.num_attention_heads
    _check_divides(f"{prefix}tensor_model_parallel_size", tp, "model.num_query_groups", groups)
    _check_divides(f"{prefix}tensor_model_parallel_size", tp, "padded vocab size", model.padded_vocab_size,
                   hint="raise model.make_vocab_size_divisible_by to a multiple of the TP size")
    _check_divides(f"{prefix}pipeline_model_parallel_size", pp, "model.num_layers", model.num_layers)
    megatron_architecture(model).validate_layout(model, tp, cp, prefix)
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel size "
            f"= {tp} x {pp} x {cp} = {model_parallel}; change the number of processes or the {prefix}* sizes"
        )
    dp = world_size // model_parallel
    if ep > 1 or model.moe.num_experts:
        if not model.moe.num_experts:
            raise ConfigError(
                f"{prefix}expert_model_parallel_size={ep} needs an MoE model (model.moe.num_experts is null)"
            )
        _check_divides(f"{prefix}expert_model_parallel_size", ep, "model.moe.num_experts", model.moe.num_experts)
    expert_model_parallel = etp * ep * pp
    if world_size % expert_model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by expert tensor x expert x pipeline parallel size "
            f"= {etp} x {ep} x {pp} = {expert_model_parallel}"
        )
    if model.moe.num_experts and tp > 1 and not parallel.sequence_parallel:
        raise ConfigError(
            f"an MoE model with {prefix}tensor_model_parallel_size={tp} needs parallel.sequence_parallel=true "
            "(Megatron-Core refuses MoE + TP without SP in training)"
        )
    if parallel.sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1")
    if parallel.overlap_param_gather and not parallel.use_distributed_optimizer:
        # Megatron's DDP would ignore the flag: refuse it rather than silently do nothing.
        raise ConfigError("parallel.overlap_param_gather=true needs parallel.use_distributed_optimizer=true "
                          "(Megatron's DDP gathers parameters only from distributed-optimizer shards)")
    if check_this_machine and cp > 1 and torch.cuda.is_available() and not transformer_engine_available():
        # On CPU the local spec's context-parallel attention (model/cpu_spec.py: keys and values
        # all-gathered over CP) is the reference; on a GPU it would forfeit what CP is for.
        raise ConfigError("parallel.context_parallel_size > 1 needs Transformer Engine on a CUDA device "
                          "(not importable here)")
    return Layout(world_size, tp, pp, cp, ep, etp, dp, world_size // expert_model_parallel)


def _check_divides(size_key: str, size: int, target_key: str, target: int, hint: str = "") -> None:
    if target % size:
        extra = f"; {hint}" if hint else ""
        raise ConfigError(f"{size_key}={size} does not divide {target_key}={target}{extra}")


def initialize_model_parallel(parallel: ParallelConfig, seed: int, *, timeout_minutes: float | None = None,
                              cuda_graphs: bool = False) -> None:
    """Create Megatron's process groups for ``parallel`` and seed the model-parallel RNGs.

    ``torch.distributed`` must already be initialised (gloo on CPU, nccl on GPU).
    ``timeout_minutes``: collective timeout of every group Megatron creates
    (``distributed.timeout_minutes``); None = the schema's default. ``cuda_graphs``: some model of
    the run will replay CUDA graphs (``rollout.cuda_graphs``): on a GPU the RNG tracker is megatron-core's
    graph-safe one (its graph managers refuse any other; the dropout streams differ from the default one).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_cascade.config.schema import DistributedConfig

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes or DistributedConfig().timeout_minutes,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs and torch.cuda.is_available())


def build_decode_process_groups(layout: Layout, timeout_minutes: float | None = None):
    """The ``ProcessGroupCollection`` of a decode layout (``rollout.parallel``, no CP): TP, PP and
    expert groups over the same world as the training layout, ranks in Megatron's order (TP fastest,
    then DP, then PP; experts: ETP, EP, expert-DP, PP), and each pipeline's embedding groups (its first
    and last stage; the first alone for position embeddings). Collective: every rank must call it, in
    the same order.

    After Megatron-LM's ``build_inference_pg_collection`` (``megatron/rl/parallel_utils.py``).
    """
    import datetime

    import torch.distributed as dist
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_cascade.config.schema import DistributedConfig

    if layout.cp != 1:
        raise ValueError(f"a decode layout has no context parallelism (CP={layout.cp})")
    timeout = datetime.timedelta(minutes=timeout_minutes or DistributedConfig().timeout_minutes)
    dense = HyperCommGrid([layout.tp, 1, layout.dp, layout.pp], ["tp", "cp", "dp", "pp"])
    expert = HyperCommGrid([layout.etp, layout.ep, layout.expert_dp, layout.pp], ["tp", "ep", "dp", "pp"])

    def dense_group(dims):
        return dense.create_pg(dims, timeout=timeout)

    pgs = dict(tp=dense_group("tp"), cp=dense_group("cp"), pp=dense_group("pp"), dp=dense_group("dp"),
               mp=dense_group(["tp", "pp"]), tp_cp=dense_group(["tp", "cp"]), dp_cp=dense_group(["cp", "dp"]),
               tp_dp_cp=dense_group(["tp", "cp", "dp"]), ep=expert.create_pg("ep", timeout=timeout),
               expt_tp=expert.create_pg("tp", timeout=timeout), expt_dp=expert.create_pg("dp", timeout=timeout),
               tp_ep=expert.create_pg(["tp", "ep"], timeout=timeout),
               tp_ep_pp=expert.create_pg(["tp", "ep", "pp"], timeout=timeout))
    # A pipeline's ends embed and compute the output (tied embeddings sync over the pair); without PP
    # every rank is both. Every rank creates every group (new_group is collective).
    me = dist.get_rank()
    for ranks in dense.get_rank_enum("pp"):
        embd = dist.new_group(sorted({ranks[0], ranks[-1]}), timeout=timeout)
        pos_embd = dist.new_group([ranks[0]], timeout=timeout)
        if me in ranks:
            pgs["embd"] = embd if me in (ranks[0], ranks[-1]) else None
            pgs["pos_embd"] = pos_embd if me == ranks[0] else None
    return ProcessGroupCollection(**pgs)
