"""Same weights, same input: logits and gradients at TP=2, PP=2 and EP=2 equal TP=PP=EP=1.

The reference runs in one process. Each parallel layout runs on 2 gloo processes, loads the
reference weights through a distributed checkpoint, and returns its logits gathered to full size;
its gradients are written as a distributed checkpoint and re-assembled at TP=1 to compare whole.
The loss is sum(logits * R) over the global batch, with each data-parallel rank taking its slice of
the batch and gradients summed over data-parallel replicas, so every layout computes the same sum, in
another order: results agree within a few fp32 roundoffs of each tensor's scale
(``megatron_cascade/testing/tolerances.py``).
"""

from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.testing.checkpoints import full_state_dict
from megatron_cascade.testing.tolerances import assert_equal_up_to_summation_order

pytestmark = pytest.mark.distributed

DENSE = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=200,
                    ffn_hidden_size=96)
MOE = replace(DENSE, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=48,
                                   token_dispatcher_type="allgather"))
MOE_ALLTOALL = replace(MOE, moe=replace(MOE.moe, token_dispatcher_type="alltoall"))
BATCH, SEQ = 4, 12


def _inputs(model_cfg):
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, model_cfg.vocab_size, (BATCH, SEQ), generator=gen)
    weights = torch.randn(BATCH, SEQ, model_cfg.padded_vocab_size, generator=gen)
    return tokens, weights


def _run_layout(model_cfg, parallel, tokens, weights, weights_dir, grads_dir, init=False):
    """One layout: (init and save, or load) weights; forward+backward; return full logits (last stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_cascade.testing.checkpoints import model_with_shared_weights, save_gradients_as_checkpoint

    model = model_with_shared_weights(model_cfg, parallel, weights_dir, init, seed=1234)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local_tokens = tokens.chunk(dp)[dp_rank]
    local_weights = weights.chunk(dp)[dp_rank]
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    local_weights = local_weights.chunk(tp, dim=-1)[tp_rank]
    captured = {}

    def loss_func(logits):
        captured["logits"] = logits.detach().clone()
        return (logits * local_weights).sum(), {}

    def forward_step(data_iterator, model):
        toks = next(data_iterator)
        pos = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)
        return model(toks, pos, None), loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([local_tokens]), model=[model],
        num_microbatches=1, seq_length=SEQ, micro_batch_size=local_tokens.shape[0], forward_only=False,
    )
    _sum_grads_over_data_parallel(model)
    save_gradients_as_checkpoint(model, grads_dir, model_cfg)
    logits = None
    if "logits" in captured:
        logits = gather_from_tensor_model_parallel_region(captured["logits"])
        parts = [torch.empty_like(logits) for _ in range(dp)]
        torch.distributed.all_gather(parts, logits, group=ps.get_data_parallel_group())
        logits = torch.cat(parts)
    return logits


def _sum_grads_over_data_parallel(model):
    from megatron.core import parallel_state as ps

    for p in model.parameters():
        expert = not getattr(p, "allreduce", True)
        group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
        torch.distributed.all_reduce(p.grad, group=group)


def _reference_worker(model_cfg, tokens, weights, tmp):
    logits = _run_layout(model_cfg, ParallelConfig(), tokens, weights, f"{tmp}/w", f"{tmp}/g_ref", init=True)
    return logits, full_state_dict(model_cfg, f"{tmp}/g_ref")


def _layout_worker(model_cfg, parallel, tokens, weights, tmp, tag):
    logits = _run_layout(model_cfg, parallel, tokens, weights, f"{tmp}/w", f"{tmp}/g_{tag}")
    return logits, full_state_dict(model_cfg, f"{tmp}/g_{tag}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = {}
    for name, cfg in [("dense", DENSE), ("moe", MOE), ("moe_alltoall", MOE_ALLTOALL)]:
        tmp = str(tmp_path_factory.mktemp(name))
        tokens, weights = _inputs(cfg)
        logits, grads = run_distributed(_reference_worker, 1, cfg, tokens, weights, tmp)[0]
        out[name] = (cfg, tmp, tokens, weights, logits, grads)
    return out


LAYOUTS = [
    ("dense", "tp2", ParallelConfig(tensor_model_parallel_size=2)),
    ("dense", "pp2", ParallelConfig(pipeline_model_parallel_size=2)),
    ("dense", "dp2", ParallelConfig()),
    ("moe", "ep2", ParallelConfig(expert_model_parallel_size=2)),
    ("moe_alltoall", "ep2", ParallelConfig(expert_model_parallel_size=2)),
]


@pytest.mark.parametrize("kind,tag,parallel", LAYOUTS, ids=[f"{k}-{t}" for k, t, _ in LAYOUTS])
def test_layout_matches_single_process(reference, kind, tag, parallel):
    cfg, tmp, tokens, weights, ref_logits, ref_grads = reference[kind]
    results = run_distributed(_layout_worker, 2, cfg, parallel, tokens, weights, tmp, tag)
    logits = [r[0] for r in results if r[0] is not None]
    assert logits, "no rank returned logits"
    for got in logits:
        assert_equal_up_to_summation_order(got, ref_logits, "logits")
    grads = results[0][1]
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref.abs().sum() > 0 or "bias" in name, f"reference gradient of {name} is all zero"
        assert_equal_up_to_summation_order(grads[name], ref, name)
