"""The policy's training state parked in host memory while it generates (``training/state_offload.py``,
``rollout.offload_training_state``).

Two gloo ranks (DP=2) train two policies from the same weights on the same batches; one parks its
training state after every step and brings it back before the next. Even steps park the gradients
and optimizer state around a generation-time forward (the weights stay: generation on the training
model reads them); odd steps also park the weights (as while a decode copy generates). While parked,
every parked storage holds no memory (a read would fail) and the forward's log-probs are unchanged;
after six steps (Adam: moments, master weights, step counters) both policies are bit-identical,
weights and optimizer state. Cases: bf16 with the distributed optimizer (fp32 master shards apart
from the model, bf16 weights in DDP's parameter buffer), and fp32 without it, whose optimizer steps
the model's own parameters: those stay with the weights (resident unless the weights are parked).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.testing.batches import UNEVEN_SPANS, random_rl_batch

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                    ffn_hidden_size=64)
STEPS = 6


def _state_tensors(policy) -> dict[str, torch.Tensor]:
    """Every tensor a step reads, by position (bit-exact copies): the weights, and each torch
    optimizer's parameters (master weights) and state (moments, step counters)."""
    from megatron_cascade.training.state_offload import _torch_optimizers

    out = {f"param/{name}": p.detach().clone() for name, p in policy.module.named_parameters()}
    for o, opt in enumerate(_torch_optimizers(policy.optimizer)):
        for g, group in enumerate(opt.param_groups):
            for i, param in enumerate(group["params"]):
                out[f"optimizer{o}/{g}/{i}/master"] = param.detach().clone()
                for key, value in opt.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"optimizer{o}/{g}/{i}/{key}"] = value.detach().clone()
    return out


def _resident_bytes(policy) -> tuple[int, int, int]:
    """(optimizer-state, gradient-buffer, weight) storage bytes held on this rank now."""
    from megatron_cascade.training.state_offload import _torch_optimizers

    def total(tensors) -> int:
        storages = {id(t.untyped_storage()): t.untyped_storage() for t in tensors if t.numel()}
        return sum(s.nbytes() for s in storages.values())

    optim = []
    for opt in _torch_optimizers(policy.optimizer):
        optim += [p for g in opt.param_groups for p in g["params"]]
        optim += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [b.grad_data for chunk in policy.chunks for b in list(chunk.buffers) + list(chunk.expert_parallel_buffers)]
    return total(optim), total(grads), total(list(policy.module.parameters()))


def offload_worker(precision: str, distributed_optimizer: bool):
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, build_policy, forward_logprobs, train_step
    from megatron_cascade.training.state_offload import TrainingStateOffload

    parallel = ParallelConfig(use_distributed_optimizer=distributed_optimizer)
    initialize_model_parallel(parallel, seed=7)
    model = replace(MODEL, precision=precision)
    optim = OptimizerConfig(lr=3e-3, lr_warmup_steps=0)
    parked, reference = (build_policy(model, parallel, optim, total_steps=10) for _ in range(2))
    reference.module.load_state_dict(parked.module.state_dict())
    reference.optimizer.reload_model_params()
    spec = LossSpec("grpo", LossConfig(), vocab_size=MODEL.vocab_size)
    training = TrainingConfig(micro_batch_size=4)
    offload = TrainingStateOffload(parked)
    seen = []
    for step in range(STEPS):
        batch = random_rl_batch(UNEVEN_SPANS, 24, MODEL.vocab_size, seed=100 + step + torch.distributed.get_rank())
        for policy in (parked, reference):
            train_step(policy, batch, spec, training)
        weights = step % 2 == 1
        before = _resident_bytes(parked)
        offload.offload(weights=weights)
        offload.offload(weights=weights)  # a second call (an evaluation inside a step) parks nothing twice
        during = _resident_bytes(parked)
        same = None
        if not weights:  # generation on the training model reads the weights
            got = forward_logprobs(parked.chunks, batch, spec, 4)
            same = bool(torch.equal(got, forward_logprobs(reference.chunks, batch, spec, 4)))
        offload.restore()
        offload.restore()
        seen.append((weights, before, during, offload.parked_bytes, same))
    got, want = _state_tensors(parked), _state_tensors(reference)
    differ = sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))
    return seen, differ, sorted({k.rsplit("/", 1)[-1] for k in want if k.startswith("optimizer")})


@pytest.mark.parametrize("precision,distributed_optimizer", [("bf16", True), ("fp32", False)])
def test_training_state_parks_in_host_memory_and_returns_bit_for_bit(precision, distributed_optimizer):
    for seen, differ, compared in run_distributed(offload_worker, 2, precision, distributed_optimizer):
        assert not differ, f"after {STEPS} steps with the state parked around each generation: {differ[:5]}"
        assert {"exp_avg", "exp_avg_sq"} <= set(compared)  # Adam's moments were among the compared tensors
        for weights, (optim0, grads0, weights0), (optim1, grads1, weights1), left, same in seen:
            assert grads0 > 0 and grads1 == 0 and optim0 > 0 and weights0 > 0
            assert left == 0  # restored: nothing parked
            if weights:
                assert optim1 == 0 and weights1 == 0  # everything the step reads is on the host
            else:
                assert same  # log-probs of the resident weights unchanged
                assert weights1 == weights0
                if precision == "bf16":
                    assert optim1 == 0  # master shards and moments: all on the host
                else:  # the moments leave, the model's own parameters (the optimizer's) stay
                    assert 0 < optim1 < optim0
