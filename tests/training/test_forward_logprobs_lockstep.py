"""Forward-only log-probs of an MoE whose experts span data-parallel ranks, with different row
counts per rank (issue 11: expert-parallel lockstep outside generation).

EP=2 x DP=2 on 2 processes: rank 0 scores 3 rows, rank 1 one row, one row per micro-batch. The
MoE all-to-all pairs the two ranks' forwards, so both must run 3 (rank 1 pads with dummy rows);
before the change rank 0's second forward waited in the MoE all-gather for a rank that had finished
("Connection closed by peer" under gloo; NCCL hangs).
Each rank's log-probs equal one process scoring all 4 rows. TP=2+SP with EP=2 inside one replica
needs no lockstep (``expert_lockstep_needed`` is False there, no all-reduce is paid) and agrees too.
"""

from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

VOCAB = 100
MOE = replace(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, ffn_hidden_size=64),
              moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, token_dispatcher_type="alltoall"))
ROWS = {0: [0, 1, 2], 1: [3]}  # by data-parallel rank (DP=2); DP=1 scores all 4


def _batch():
    from megatron_cascade.training import TrainBatch

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (4, 14), generator=gen)
    mask = torch.zeros(4, 13)
    for row, length in enumerate([9, 4, 12, 6]):
        mask[row, 1:1 + length] = 1
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask)


def _worker(parallel: ParallelConfig, weights_dir: str, init: bool):
    from megatron.core import parallel_state as ps

    from megatron_cascade.testing.checkpoints import model_with_shared_weights
    from megatron_cascade.training import LossSpec
    from megatron_cascade.training.step import expert_lockstep_needed, forward_logprobs

    model = model_with_shared_weights(MOE, parallel, weights_dir, init, seed=3)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = ROWS[dp_rank] if dp > 1 else [0, 1, 2, 3]
    share = _batch().select(torch.tensor(rows))
    spec = LossSpec("grpo", LossConfig(), temperature=0.8, vocab_size=VOCAB)
    return rows, forward_logprobs([model], share, spec, 1), expert_lockstep_needed(model)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    weights = str(tmp_path_factory.mktemp("lockstep") / "w")
    rows, logprobs, lockstep = run_distributed(_worker, 1, ParallelConfig(), weights, True)[0]
    assert rows == [0, 1, 2, 3] and not lockstep
    return weights, logprobs


LAYOUTS = [
    ("ep2-dp2", ParallelConfig(expert_model_parallel_size=2), True),
    ("tp2-sp-ep2-etp1", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                       expert_model_parallel_size=2, expert_tensor_parallel_size=1), False),
]


@pytest.mark.parametrize("name,parallel,lockstep", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_moe_logprobs_with_different_rows_per_rank(reference, name, parallel, lockstep):
    weights, ref = reference
    results = run_distributed(_worker, 2, parallel, weights, False, timeout_s=240)
    for rows, logprobs, needed in results:
        assert needed is lockstep
        assert logprobs.shape == (len(rows), 13)
        torch.testing.assert_close(logprobs, ref[rows], atol=1e-5, rtol=1e-5)
