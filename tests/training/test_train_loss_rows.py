"""The training step runs only the rows and positions that carry loss, with the same gradient.

A GRPO batch of 8 rows x 24 positions whose first 4 rows have no loss token (a filtered group) and
whose loss ends at position 14: the model is run on 4 rows x 15 positions, and the gradient and
metrics equal those of the whole batch (reference: the same step with nothing dropped), in one
process, at a micro-batch size larger than the rows left (one micro-batch of 4 rows, not 4 rows and
4 padding rows), and at DP=2 where one rank holds only loss-free rows (it runs one dummy row, the
other rank two micro-batches).
"""

import pytest
import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                    ffn_hidden_size=64)
BATCH, SEQ, VOCAB = 8, 24, 100


def _batch():
    from megatron_cascade.training import TrainBatch

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    mask = torch.zeros(BATCH, SEQ)
    for row, length in zip(range(4, 8), [5, 12, 3, 9]):
        mask[row, 3:3 + length] = 1  # the last loss position is 14
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask,
                      advantages=torch.randn(BATCH, generator=gen),
                      inference_logprobs=-torch.rand(BATCH, SEQ, generator=gen) * 6)


def _step_worker(parallel, drop, weights_dir, init, micro_batch_size=2):
    from megatron.core import parallel_state as ps

    from megatron_cascade.model import initialize_model_parallel, load_model_weights, save_model_weights
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training import step

    initialize_model_parallel(parallel, seed=3)
    policy = build_policy(MODEL, parallel, OptimizerConfig(lr=1e-3), total_steps=10)
    if init:
        save_model_weights(policy.module, weights_dir, MODEL)
    else:
        load_model_weights(policy.module, weights_dir, MODEL)
    if not drop:
        step._training_work = lambda batch, model, rows: (batch, rows)  # the reference: everything, as configured
    seen = []
    policy.module.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = _batch().select(slice(rank * BATCH // dp, (rank + 1) * BATCH // dp))
    spec = LossSpec("grpo", LossConfig(), temperature=0.7, vocab_size=VOCAB)
    metrics = step.compute_gradients(policy, share, spec, TrainingConfig(micro_batch_size=micro_batch_size))
    grads = torch.cat([p.main_grad.flatten().clone() for p in policy.module.parameters()])
    return seen, metrics, grads


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    weights = str(tmp_path_factory.mktemp("weights"))
    return weights, run_distributed(_step_worker, 1, ParallelConfig(), False, weights, True)[0]


def _assert_same_step(got, want):
    _, metrics, grads = got
    _, ref_metrics, ref_grads = want
    assert ref_grads.abs().max() > 0
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_loss_free_rows_and_positions_are_not_run(reference):
    weights, want = reference
    got = run_distributed(_step_worker, 1, ParallelConfig(), True, weights, False)[0]
    assert want[0] == [(2, SEQ)] * 4
    assert got[0] == [(2, 15)] * 2, "only the 4 rows with loss, up to the last loss position"
    _assert_same_step(got, want)


def test_micro_batches_shrink_to_the_rows_left(reference):
    weights, want = reference
    got = run_distributed(_step_worker, 1, ParallelConfig(), True, weights, False, 8)[0]
    assert got[0] == [(4, 15)], "4 rows left at micro_batch_size 8: one micro-batch of 4, no padding rows"
    _assert_same_step(got, want)


def test_data_parallel_rank_without_loss_rows(reference):
    weights, want = reference
    ranks = run_distributed(_step_worker, 2, ParallelConfig(), True, weights, False)
    assert ranks[0][0] == [(1, 1)], "a rank without loss rows runs one dummy row"
    assert ranks[1][0] == [(2, 15)] * 2
    for got in ranks:
        _assert_same_step(got, want)
