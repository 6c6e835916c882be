"""The policy's gradients and optimizer state (and, while a decode copy generates, its weights) in
host memory during generation (``rollout.offload_training_state``).

Between an optimizer step and the next training forward, generation reads only weights: the fp32
gradient buffers (2x the bf16 weights) and Adam's state (fp32 master weights and two moments,
sharded over data-parallel ranks by the distributed optimizer) sit unused on the GPU — 9.8 of the
Qwen3-30B-A3B recipe's 12.0 GiB per GPU. Parked in host memory for the rollout they give the KV
cache that room, at the price of one host round trip per step.

* Gradients: megatron-core's ``DistributedDataParallel.offload_grad_buffers`` releases the buffers'
  storage and keeps every view (``main_grad``); ``restore_grad_buffers`` reallocates them zeroed, as
  the next step zeroes them anyway.
* Optimizer state: megatron-core's ``MegatronOptimizer.offload_to_cpu`` is not used. It moves only
  CUDA tensors (so nothing on CPU, where CI runs) and its ``restore_from_cpu`` puts every host tensor
  on the GPU — Adam's ``step`` counters, which torch keeps on the host, included. Here each storage
  of the state is copied to (pinned) host memory and released in place, and refilled in place on
  restore: parameters, views and the optimizer's references stay the same objects and the bits the
  same. Storages the model owns are left alone (an fp32 policy's optimizer steps the model's own
  parameters, which generation still reads).
* Weights, only when generation runs on the decode copy (``rollout.parallel``), which was refit from
  them first: the same copy-out and release, bit for bit back (2.2 of the recipe's 12.0 GiB).

Host buffers (pinned on GPU) are kept from one generation to the next: the host memory the dry run
counts per node stays reserved, and no step pays for a pinned allocation.
"""

from __future__ import annotations

import time

import torch

from megatron_cascade.training.policy import Policy


class TrainingStateOffload:
    """Parks one policy's training state in host memory and brings it back.

    ``offload`` and ``restore`` are idempotent and local to this rank (no collective); ``seconds``
    sums their wall time (the caller resets it).
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.seconds = 0.0
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (released storage, its bytes on the host)
        self._host: list[torch.Tensor] = []  # host buffers, reused by position from one offload to the next
        self._grads_parked = False

    @property
    def parked_bytes(self) -> int:
        """Bytes now copied to host memory (optimizer state, weights; gradients are released, not copied)."""
        return sum(host.numel() for _, host in self._parked)

    def offload(self, weights: bool = False) -> None:
        """Release the gradient buffers; copy the optimizer state (and with ``weights`` the model's
        parameters: only when nothing reads them until ``restore``) to host memory and release it."""
        if self._grads_parked:
            return
        start = time.perf_counter()
        cuda = torch.cuda.is_available()
        model_weights, model_grads = _model_storages(self.policy)
        storages = _optimizer_storages(self.policy, set(model_weights) | model_grads)
        if weights:
            storages += [s for key, s in model_weights.items() if s.nbytes() and key not in model_grads]
        for chunk in self.policy.chunks:
            chunk.offload_grad_buffers(synchronize=cuda, empty_cache=False)
        self._grads_parked = True
        for i, storage in enumerate(storages):
            if i == len(self._host) or self._host[i].numel() != storage.nbytes():
                self._host[i:] = [torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=cuda)]
            self._host[i].copy_(_bytes_of(storage), non_blocking=cuda)
            self._parked.append((storage, self._host[i]))
        if cuda:
            torch.cuda.synchronize()  # the copies are done before their sources go
        for storage, _ in self._parked:
            storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()  # the KV budget is sized from what is free
        self.seconds += time.perf_counter() - start

    def restore(self) -> None:
        """Bring the parked storages back bit for bit, and the gradient buffers (zeroed)."""
        if not self._grads_parked:
            return
        start = time.perf_counter()
        cuda = torch.cuda.is_available()
        for storage, host in self._parked:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=cuda)
        for chunk in self.policy.chunks:
            chunk.restore_grad_buffers(synchronize=False)
        if cuda:
            torch.cuda.synchronize()  # before the next offload overwrites the host buffers
        self._parked = []
        self._grads_parked = False
        self.seconds += time.perf_counter() - start


def _model_storages(policy: Policy) -> tuple[dict[int, torch.UntypedStorage], set[int]]:
    """The model's parameter storages by key (parameters, DDP's parameter buffers), and the keys of
    its gradient buffers."""
    weights = {}
    for chunk in policy.chunks:
        for param in chunk.parameters():
            weights[_key(param)] = param.untyped_storage()
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            if buffer.param_data is not None:
                weights[_key(buffer.param_data)] = buffer.param_data.untyped_storage()
    grads = {_key(b.grad_data) for chunk in policy.chunks
             for b in list(chunk.buffers) + list(chunk.expert_parallel_buffers) if b.grad_data is not None}
    return weights, grads


def _optimizer_storages(policy: Policy, owned: set[int]) -> list[torch.UntypedStorage]:
    """The distinct storages of the optimizer's parameters (master weights) and state tensors, less
    those the model owns (``owned``: keys of its parameters, parameter and gradient buffers)."""
    found: dict[int, torch.UntypedStorage] = {}
    for optimizer in _torch_optimizers(policy.optimizer):
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() and _key(tensor) not in owned:
                found[_key(tensor)] = storage
    return list(found.values())


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron (possibly chained) optimizer."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [part.optimizer for part in parts if getattr(part, "optimizer", None) is not None]


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
