"""Training checkpoints resume at another parallel layout, to the weights of an uninterrupted run.

A run trains 2 steps, saves a training checkpoint, trains 2 more (the uninterrupted reference). A
second run at another layout resumes from the checkpoint and trains the same 2 steps. Both end at the
same weights (fp32, 1e-6), compared whole through checkpoints re-assembled at TP=1:
* DP=2 -> DP=1 with the distributed optimizer (its state saved in the layout-free ``fully_reshardable``
  form and re-sharded on load);
* TP=2 -> TP=1 with the plain optimizer.
Adam's eps is 1e-3 (not 1e-8): with 1e-8 Adam turns float noise in near-zero gradients into full-size
updates, and runs that differ only in reduction order drift apart by ~1e-5 (notes/mixed_precision_optimizer.md).
Also: a checkpoint of one optimizer kind is refused by the other, naming the key; and with
``overlap_param_gather`` a checkpoint written right after a step holds that step's weights.
"""

import os
from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.model import MoEConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.testing.checkpoints import full_state_dict

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                    ffn_hidden_size=64)
OPTIM = OptimizerConfig(lr=1e-2, adam_eps=1e-3, weight_decay=0.01, lr_decay_style="linear", min_lr=1e-3)
BATCH, SEQ, STEPS = 8, 16, 4


def _batch(step: int):
    """This data-parallel rank's share of step ``step``'s global batch."""
    from megatron.core import parallel_state as ps

    from megatron_cascade.training import TrainBatch

    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1), generator=gen)
    mask = (torch.rand(BATCH, SEQ, generator=gen) < 0.8).float()
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp)
    return TrainBatch(input_ids=ids[rows, :-1], target_ids=ids[rows, 1:], loss_mask=mask[rows])


def _train(policy, steps) -> None:
    from megatron_cascade.training import LossSpec, train_step

    spec = LossSpec("sft", LossConfig(), vocab_size=MODEL.vocab_size)
    for step in steps:
        metrics = train_step(policy, _batch(step), spec, TrainingConfig(micro_batch_size=2))
        assert metrics["skipped"] == 0.0


def _run_worker(parallel: ParallelConfig, root: str, final: str, resume: bool):
    """Save run (``resume=False``): 2 steps, checkpoint, 2 steps. Resumed run: load, the last 2 steps."""
    from megatron_cascade.model import initialize_model_parallel, save_model_weights
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import load_training_checkpoint, save_training_checkpoint

    initialize_model_parallel(parallel, seed=5)
    policy = build_policy(MODEL, parallel, OPTIM, total_steps=STEPS)
    if resume:
        state = load_training_checkpoint(os.path.join(root, "step_00000002"), policy)
        assert state["step"] == 2
    else:
        _train(policy, range(2))
        save_training_checkpoint(root, 2, policy, {}, keep_last=1)
    _train(policy, range(2, STEPS))
    save_model_weights(policy.module, final, MODEL)
    at_checkpoint = None if resume else full_state_dict(MODEL, os.path.join(root, "step_00000002", "weights"))
    return full_state_dict(MODEL, final), at_checkpoint


RESHARDS = [
    ("dp2_to_dp1_distributed_optimizer", ParallelConfig(use_distributed_optimizer=True),
     ParallelConfig(use_distributed_optimizer=True)),
    ("tp2_to_tp1_plain_optimizer", ParallelConfig(tensor_model_parallel_size=2), ParallelConfig()),
]


@pytest.mark.parametrize("name,saved_at,resumed_at", RESHARDS, ids=[r[0] for r in RESHARDS])
def test_resume_at_another_layout_continues_like_an_uninterrupted_run(tmp_path, name, saved_at, resumed_at):
    root = str(tmp_path / "ckpt")
    uninterrupted, at_checkpoint = run_distributed(_run_worker, 2, saved_at, root, str(tmp_path / "a"), False)[0]
    resumed, _ = run_distributed(_run_worker, 1, resumed_at, root, str(tmp_path / "b"), True)[0]
    for key, want in uninterrupted.items():
        torch.testing.assert_close(resumed[key], want, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")
    # The steps after the checkpoint moved the weights (the comparison is not of untouched tensors).
    moved = sum(int((at_checkpoint[k] - v).abs().max() > 1e-4) for k, v in uninterrupted.items())
    assert moved > len(uninterrupted) // 2


def _kind_mismatch_worker(root: str) -> str:
    from megatron_cascade.model import CheckpointError, initialize_model_parallel
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import load_training_checkpoint, save_training_checkpoint

    initialize_model_parallel(ParallelConfig(), seed=5)
    save_training_checkpoint(root, 1, build_policy(MODEL, ParallelConfig(), OPTIM, total_steps=STEPS), {}, 1)
    policy = build_policy(MODEL, ParallelConfig(use_distributed_optimizer=True), OPTIM, total_steps=STEPS)
    try:
        load_training_checkpoint(os.path.join(root, "step_00000001"), policy)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_plain_optimizer_checkpoint_is_refused_by_the_distributed_optimizer_naming_the_key(tmp_path):
    message = run_distributed(_kind_mismatch_worker, 1, str(tmp_path / "ckpt"))[0]
    assert "plain optimizer state but parallel.use_distributed_optimizer=True" in message, message
    assert "resume with parallel.use_distributed_optimizer=false" in message, message


def _overlap_worker(root: str):
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import save_training_checkpoint
    from megatron_cascade.training.policy import finish_param_sync

    parallel = ParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    initialize_model_parallel(parallel, seed=5)
    policy = build_policy(MODEL, parallel, OPTIM, total_steps=STEPS)
    _train(policy, range(1))
    saved = save_training_checkpoint(root, 1, policy, {}, keep_last=1)
    finish_param_sync(policy)
    after_step = {k: v.detach().clone() for k, v in policy.module.state_dict().items() if not k.endswith("_extra_state")}
    reloaded = build_gpt_model(MODEL, parallel)
    load_model_weights(reloaded, os.path.join(saved, "weights"), MODEL)
    return after_step, {k: v for k, v in reloaded.state_dict().items() if not k.endswith("_extra_state")}


def test_overlap_param_gather_checkpoint_right_after_a_step_holds_that_steps_weights(tmp_path):
    for after_step, saved in run_distributed(_overlap_worker, 2, str(tmp_path / "ckpt")):
        for key, want in after_step.items():
            torch.testing.assert_close(saved[key], want, atol=0, rtol=0, msg=lambda m: f"{key}: {m}")


def _same_process_resume_worker(parallel: ParallelConfig, model: ModelConfig, root: str, steps_before: int):
    """One policy saves after ``steps_before`` steps, a second one loads that; both train 2 more steps."""
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import build_policy
    from megatron_cascade.training.resume_checkpoint import load_training_checkpoint, save_training_checkpoint

    initialize_model_parallel(parallel, seed=5)
    uninterrupted = build_policy(model, parallel, OPTIM, total_steps=STEPS)
    _train(uninterrupted, range(steps_before))
    saved = save_training_checkpoint(root, steps_before, uninterrupted, {}, keep_last=1)
    resumed = build_policy(model, parallel, OPTIM, total_steps=STEPS)
    load_training_checkpoint(saved, resumed)
    _train(uninterrupted, range(steps_before, steps_before + 2))
    _train(resumed, range(steps_before, steps_before + 2))
    return [(a.detach().clone(), b.detach().clone())
            for a, b in zip(uninterrupted.module.parameters(), resumed.module.parameters())]


MOE = replace(MODEL, moe=MoEConfig(num_experts=2, router_topk=2))
SAME_LAYOUT = [
    # A checkpoint before the first optimizer step (e.g. every step so far skipped): no Adam state yet.
    ("before_first_step_plain", ParallelConfig(), MODEL, 0),
    ("before_first_step_distributed", ParallelConfig(use_distributed_optimizer=True), MODEL, 0),
    # MoE: Megatron chains two optimizers (dense and expert parameters).
    ("moe_chained_distributed", ParallelConfig(use_distributed_optimizer=True), MOE, 1),
]


@pytest.mark.parametrize("name,parallel,model,steps_before", SAME_LAYOUT, ids=[c[0] for c in SAME_LAYOUT])
def test_resume_in_the_same_process_continues_identically(tmp_path, name, parallel, model, steps_before):
    pairs = run_distributed(_same_process_resume_worker, 1, parallel, model, str(tmp_path / "ckpt"), steps_before)[0]
    for want, got in pairs:
        torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
