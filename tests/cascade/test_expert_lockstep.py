"""Expert-parallel lockstep outside generation (issue 11): an MoE whose experts span data-parallel
ranks (EP=2 x DP=2 on 2 processes) runs MOPD teacher passes and evaluation with different work per
rank, and every rank gets what one process computes alone.

* Teacher pass: rank 0 holds only domain ``alpha`` rows (3), rank 1 only ``beta`` rows (2), each
  domain with its own teacher. Before the change each rank ran only its own domain's teacher: the
  all-to-all paired teacher alpha's forwards on rank 0 with teacher beta's experts on rank 1 (wrong
  log-probs, silently), and the third alpha forward waited for a rank that had finished.
* Evaluation: one eval prompt, so rank 1 has none; it must still run generate's dummy forwards.
  Before the change it skipped ``generate`` and rank 0's first MoE all-to-all waited for it until
  the test's timeout.
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
EP2_DP2 = ParallelConfig(expert_model_parallel_size=2)
DOMAINS = ["alpha"] * 3 + ["beta"] * 2
ROWS = {0: [0, 1, 2], 1: [3, 4]}  # by data-parallel rank: one domain each


def _batch():
    from megatron_cascade.training import TrainBatch

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (5, 12), generator=gen)
    mask = torch.zeros(5, 11)
    for row, length in enumerate([8, 3, 10, 5, 7]):
        mask[row, 1:1 + length] = 1
    return TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=mask)


def _save_teachers(parallel: ParallelConfig, tmp: str) -> None:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_cascade.model import build_gpt_model, save_model_weights

    for name, seed in (("alpha", 1), ("beta", 2)):
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        save_model_weights(build_gpt_model(MOE, parallel), f"{tmp}/{name}", MOE)


def _teacher_worker(parallel: ParallelConfig, tmp: str, init: bool):
    from megatron.core import parallel_state as ps

    from megatron_cascade.stages.teachers import TeacherPool, teacher_logprobs
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec

    initialize_model_parallel(parallel, seed=3)
    if init:
        _save_teachers(parallel, tmp)
    pool = TeacherPool({d: f"{tmp}/{d}" for d in ("alpha", "beta")}, MOE, parallel, "fingerprint")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = ROWS[dp_rank] if dp > 1 else list(range(len(DOMAINS)))
    spec = LossSpec("mopd", LossConfig(), temperature=1.0, vocab_size=VOCAB)
    out = teacher_logprobs(pool, _batch().select(torch.tensor(rows)), [DOMAINS[i] for i in rows], spec, 1)
    return rows, out


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("teachers"))
    rows, logprobs = run_distributed(_teacher_worker, 1, ParallelConfig(), tmp, True)[0]
    assert rows == [0, 1, 2, 3, 4]
    return tmp, logprobs


def test_teacher_pass_with_one_domain_per_rank(teachers):
    tmp, ref = teachers
    results = run_distributed(_teacher_worker, 2, EP2_DP2, tmp, False, timeout_s=240)
    assert [rows for rows, _ in results] == [ROWS[0], ROWS[1]]
    for rows, logprobs in results:
        torch.testing.assert_close(logprobs, ref[rows], atol=1e-5, rtol=1e-5)


# -- evaluation ---------------------------------------------------------------------------------

def _first_char_score(response: str, sample: dict) -> float:
    """A reward that depends on the generated text (so that equal scores mean equal tokens, mostly)."""
    return (ord(response[0]) % 11) / 10 if response else 0.0


def _eval_worker(parallel: ParallelConfig, tmp: str, init: bool):
    from megatron_cascade.stages.prompt_data import Example
    from megatron_cascade.cascade.evaluation import evaluate
    from megatron_cascade.config.schema import DomainConfig, EvalConfig, RolloutConfig, RewardSpec
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights
    from megatron_cascade.model import save_model_weights
    from megatron_cascade.tokenizers import CharTokenizer

    tok = CharTokenizer()
    model_cfg = replace(MOE, vocab_size=tok.vocab_size)
    initialize_model_parallel(parallel, seed=3)
    model = build_gpt_model(model_cfg, parallel)
    if init:
        save_model_weights(model, f"{tmp}/policy", model_cfg)
    else:
        load_model_weights(model, f"{tmp}/policy", model_cfg)
    prompt = tuple(tok.encode("2+2="))
    eval_sets = {"alpha": [Example("alpha", prompt, {"prompt": "2+2="}, "eval.jsonl:1")]}
    domains = {"alpha": DomainConfig(reward=RewardSpec(name="custom"))}
    return evaluate(model, eval_sets, {"alpha": _first_char_score}, domains, tok,
                    EvalConfig(max_new_tokens=6), RolloutConfig(), seed=0)


def test_evaluation_with_a_rank_without_prompts(tmp_path):
    ref = run_distributed(_eval_worker, 1, ParallelConfig(), str(tmp_path), True)[0]
    results = run_distributed(_eval_worker, 2, EP2_DP2, str(tmp_path), False, timeout_s=240)
    assert results[0] == results[1] == ref


def _packed_teacher_worker(tmp: str):
    """The teacher pass as a MOPD stage with ``training.sequence_packing`` runs it: packed rows (seen
    by a counter on the packed path), the padded pass's log-probs on every loss token."""
    from megatron_cascade.stages.teachers import TeacherPool, teacher_logprobs
    from megatron_cascade.config.training import TrainingConfig
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, step

    initialize_model_parallel(ParallelConfig(), seed=3)
    pool = TeacherPool({d: f"{tmp}/{d}" for d in ("alpha", "beta")}, MOE, ParallelConfig(), "fingerprint")
    spec = LossSpec("mopd", LossConfig(), temperature=1.0, vocab_size=VOCAB)
    calls, packed_pass = [], step._packed_forward_logprobs
    step._packed_forward_logprobs = lambda *a, **k: calls.append(1) or packed_pass(*a, **k)
    options = step.logprob_pass_options(TrainingConfig(micro_batch_size=2, sequence_packing=True))
    return teacher_logprobs(pool, _batch(), DOMAINS, spec, **options), len(calls)


def test_teacher_pass_packs_with_sequence_packing(teachers):
    tmp, ref = teachers
    packed, packed_passes = run_distributed(_packed_teacher_worker, 1, tmp, timeout_s=240)[0]
    assert packed_passes == 2  # one per teacher
    mask = _batch().loss_mask.bool()
    torch.testing.assert_close(packed[mask], ref[mask], atol=1e-5, rtol=1e-5)
