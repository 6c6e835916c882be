"""The MoE load-balancing loss is weighted like the policy loss (``model/moe_aux_loss.py``).

Value: the aux-loss part of the last router's weight gradient (gradient with the loss minus gradient
without it, same weights and batch) equals coeff x the gradient of the documented objective computed
in float64 from the router inputs of the run: per sequence (``seq_aux_loss``) or per micro-batch
(``aux_loss``) Switch losses over non-padding tokens, each weighted by its loss tokens / the global
loss-token count. 4 sequences with right padding, 2 micro-batches.

Layout: with ``aux_loss`` (a per-micro-batch loss) the gradient at DP=2 and at TP=2 + SP (padding
masks scattered with the sequence) equals the single-rank one for the same micro-batches.
"""

from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.testing.checkpoints import full_state_dict, save_gradients_as_checkpoint

pytestmark = pytest.mark.distributed

COEFF = 1.0
MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                  ffn_hidden_size=64, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32,
                                                    token_dispatcher_type="alltoall", aux_loss_coeff=COEFF))
LENGTHS = [16, 11, 7, 13]  # real tokens per row; the rest of the 16 positions is padding
RESPONSES = [9, 2, 4, 6]  # loss tokens per row
BATCH, SEQ, MICRO = 4, 16, 2


def _batch():
    from megatron_cascade.training import TrainBatch

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, MOE.vocab_size, (BATCH, SEQ + 1), generator=gen)
    mask = torch.zeros(BATCH, SEQ)
    padding = torch.ones(BATCH, SEQ, dtype=torch.bool)
    for row, (length, response) in enumerate(zip(LENGTHS, RESPONSES)):
        mask[row, length - 1 - response:length - 1] = 1
        padding[row, :length] = False
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask, padding_mask=padding)


def _with_coeff(model, kind, coeff):
    return replace(model, moe=replace(model.moe, router_load_balancing_type=kind, aux_loss_coeff=coeff))


def _last_router(policy):
    return policy.module.decoder.layers[-1].mlp.router


def _aux_gradient_worker(kind, weights_dir):
    """Aux-loss part of the last router's weight gradient, and what the reference needs."""
    from megatron_cascade.model import initialize_model_parallel, load_model_weights, save_model_weights
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import compute_gradients

    initialize_model_parallel(ParallelConfig(), seed=5)
    spec, training = LossSpec("sft", LossConfig()), TrainingConfig(micro_batch_size=MICRO)
    grads, inputs = [], []
    for i, coeff in enumerate((COEFF, 0.0)):
        model_cfg = _with_coeff(MOE, kind, coeff)
        policy = build_policy(model_cfg, ParallelConfig(), OptimizerConfig(lr=1e-3), total_steps=1)
        (save_model_weights if i == 0 else load_model_weights)(policy.module, weights_dir, model_cfg)
        router = _last_router(policy)
        hook = router.register_forward_hook(lambda mod, args, out: inputs.append(args[0].detach().clone()))
        compute_gradients(policy, _batch(), spec, training)
        hook.remove()
        grads.append(router.weight.main_grad.detach().clone())
    return grads[0] - grads[1], inputs[: BATCH // MICRO], router.weight.detach().clone()


def _switch_loss(scores, routing, valid):
    """E / (k T^2) * sum_i P_i c_i over the ``valid`` tokens of [T, E] scores / routing map."""
    scores, routing = scores[valid], routing[valid].to(scores.dtype)
    tokens = valid.sum()
    experts, topk = scores.shape[-1], MOE.moe.router_topk
    return experts / (topk * tokens**2) * (scores.sum(0) * routing.sum(0)).sum()


def _reference_aux_gradient(kind, inputs, weight):
    """coeff x d/dW of the documented objective, in float64, from the router inputs [S, b, H]."""
    batch = _batch()
    weight = weight.to(torch.float64).requires_grad_(True)
    row_weights = batch.loss_mask.sum(-1).to(torch.float64) / batch.loss_mask.sum()
    total = torch.zeros((), dtype=torch.float64)
    for k, x in enumerate(inputs):
        rows = slice(k * MICRO, (k + 1) * MICRO)
        scores = torch.softmax(x.to(torch.float64) @ weight.T, dim=-1)  # [S, b, E]
        routing = torch.zeros_like(scores).scatter(-1, scores.topk(MOE.moe.router_topk, dim=-1).indices, 1.0).bool()
        valid = ~batch.padding_mask[rows].T  # [S, b]
        if kind == "seq_aux_loss":
            for b, w in enumerate(row_weights[rows]):
                total = total + w * _switch_loss(scores[:, b], routing[:, b], valid[:, b])
        else:
            flat = (scores.reshape(-1, scores.shape[-1]), routing.reshape(-1, scores.shape[-1]), valid.reshape(-1))
            total = total + row_weights[rows].sum() * _switch_loss(*flat)
    (COEFF * total).backward()
    return weight.grad


@pytest.mark.parametrize("kind", ["seq_aux_loss", "aux_loss"])
def test_aux_loss_gradient_is_the_documented_objective(tmp_path, kind):
    aux_grad, inputs, weight = run_distributed(_aux_gradient_worker, 1, kind, str(tmp_path / "w"))[0]
    expected = _reference_aux_gradient(kind, inputs, weight).to(torch.float32)
    assert expected.abs().max() > 1e-3, "the aux loss barely moves the router: the test would prove nothing"
    torch.testing.assert_close(aux_grad, expected, rtol=1e-4, atol=1e-7)


def _split_worker(parallel, weights_dir, grads_dir, init):
    from megatron.core import parallel_state as ps

    from megatron_cascade.model import initialize_model_parallel, load_model_weights, save_model_weights
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import compute_gradients

    model_cfg = _with_coeff(MOE, "aux_loss", COEFF)
    initialize_model_parallel(parallel, seed=5)
    policy = build_policy(model_cfg, parallel, OptimizerConfig(lr=1e-3), total_steps=1)
    (save_model_weights if init else load_model_weights)(policy.module, weights_dir, model_cfg)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = _batch().select(slice(rank * BATCH // dp, (rank + 1) * BATCH // dp))
    compute_gradients(policy, share, LossSpec("sft", LossConfig()), TrainingConfig(micro_batch_size=MICRO))
    save_gradients_as_checkpoint(policy.module, grads_dir, model_cfg)
    return full_state_dict(model_cfg, grads_dir)


def test_micro_batch_aux_loss_gradient_does_not_depend_on_the_layout(tmp_path):
    reference = run_distributed(_split_worker, 1, ParallelConfig(), str(tmp_path / "w"), str(tmp_path / "g"), True)[0]
    layouts = {"dp2": ParallelConfig(),  # the SP split shards each sequence's router statistics over TP
               "tp2-sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)}
    for name, parallel in layouts.items():
        grads = run_distributed(_split_worker, 2, parallel, str(tmp_path / "w"), str(tmp_path / name), False)[0]
        for key, ref in reference.items():
            torch.testing.assert_close(grads[key], ref, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} {key}: {m}")
