"""CUDA graphs for decode steps: which layers megatron-core 0.16.1 may replay from a graph, and when.

A model built with ``cuda_graph_impl="local"`` gives every graphable layer (``TransformerLayer``,
``MambaLayer``) a ``CudaGraphManager``, which captures a graph the first time the layer runs under an
inference context with a new padded batch size and replays it afterwards. Two things there do not fit
our decode copy, so ``graph_decode_steps_only`` narrows it:

* **Only decode steps matched to a graph size.** ``MambaLayer`` goes to its manager in every
  inference step (prefills and mixed steps too, each new size captured: the varlen prefill kernels
  are not capturable, and the sizes are unbounded); ``TransformerLayer`` does so only for graph
  steps. Each graphed layer asks ``_decode_step_only`` instead: a dynamic context whose step the
  context padded to one of its graph sizes (``PagedContext`` built with ``cuda_graphs``).
* **No layer holding a MoE block.** The alltoall dispatcher copies token counts to the host in every
  forward (not capturable), and megatron-core refuses its partial MoE graphs under inference
  (``MoETransformerLayer._forward_mlp``). Those layers run eagerly between graphed ones; the padded
  tokens pass through them like real ones (their outputs are never sampled).

Graphs hold the addresses of the call's KV buffer and of the copy's weights, both of which are freed
after generation, so ``release_cuda_graphs`` drops them at the end of every ``generate`` call and the
next call captures again (one capture per size actually used).
"""

from __future__ import annotations

import torch


def graph_decode_steps_only(model: torch.nn.Module) -> int:
    """Restrict ``model``'s CUDA graph managers to decode steps of layers without a MoE block (see the
    module docstring); returns how many layers keep one."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    graphed = 0
    for module in model.modules():
        if not hasattr(module, "cudagraph_manager"):
            continue
        if isinstance(getattr(module, "mlp", None), MoELayer):
            del module.cudagraph_manager
            continue
        module._should_call_local_cudagraph = _decode_step_only
        graphed += 1
    return graphed


def _decode_step_only(*args, **kwargs) -> bool:
    """Whether this forward replays (or captures) the layer's graph: a paged step padded to a graph size."""
    context = kwargs.get("inference_context")
    return (context is not None and not context.is_static_batching()
            and bool(context.using_cuda_graph_this_step()))


def release_cuda_graphs() -> None:
    """Drop every captured graph (their KV buffer and weights are about to be freed); a no-op without CUDA."""
    if not torch.cuda.is_available():
        return
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    delete_cuda_graphs()
