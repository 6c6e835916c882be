"""A reward that errors or times out makes its sample invalid, not a real 0 (issue 12).

* One GRPO rollout step of a tiny real stage, with a reward that raises on some responses: those
  samples have loss mask 0 and advantage 0, and the other samples' advantages are
  ``group_advantages(valid=...)`` computed without them.
* A reward that fails on every call stops the step before the optimizer step, with an error naming
  ``rewards.max_error_frac`` and the failing domain/reward; the weights are untouched.
* With two data-parallel ranks the fraction is global: both ranks stop when only one saw errors.
* ``rewards.max_error_frac`` outside [0, 1] is a config error naming the key.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_cascade.testing import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny_cascade", "cascade.yaml")

CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 2, hidden_size: 32, ffn_hidden_size: 64}}
training: {{micro_batch_size: 16}}
rollout: {{max_new_tokens: 12}}
rewards: {{max_error_frac: {max_error_frac}}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: rl, type: grpo, steps: 1, prompts_per_step: 4, samples_per_prompt: 4, domains: {{math: 1.0}}}}
"""


def _sometimes_failing(response: str, sample: dict) -> float:
    """Raises on about a third of the responses (a deterministic function of the text)."""
    code = sum(map(ord, response))
    if code % 3 == 0:
        raise ConnectionError("reward server unreachable")
    return (code % 5) / 4


def _always_failing(response: str, sample: dict) -> float:
    raise TimeoutError("reward server timed out")


def _runner(tmp: str, max_error_frac: float, reward):
    from megatron_cascade.cascade.runner import build_context
    from megatron_cascade.cascade.stage import StageRunner
    from megatron_cascade.config import load_config, resolve_stage
    from megatron_cascade.model import initialize_model_parallel

    import torch.distributed as dist

    config = os.path.join(tmp, "run.yaml")
    if dist.get_rank() == 0:  # one writer: another rank reading it mid-write saw a truncated file
        with open(config, "w") as f:
            f.write(CONFIG.format(tiny=TINY, out=os.path.join(tmp, "out"), max_error_frac=max_error_frac))
    dist.barrier()
    cfg = load_config(config)
    initialize_model_parallel(cfg.parallel, seed=cfg.seed)
    runner = StageRunner(build_context(cfg), 0, resolve_stage(cfg, cfg.stages[0]))
    runner._build()
    runner.kind.rewards = {"math": reward}
    return runner


def _invalid_samples_worker(tmp: str):
    from megatron_cascade.rollout import KVCacheConfig, generate

    runner = _runner(tmp, 1.0, _sometimes_failing)
    examples = runner.my_share(0)
    G = runner.stage.samples_per_prompt
    # The step's rollouts (generation is seeded by the step): which rewards fail, and the scores.
    rollouts = generate(runner.policy.module, [list(e.prompt_ids) for e in examples], runner.kind.sampling(0, G),
                        tokenizer=runner.tok, kv_cache=KVCacheConfig.from_rollout(runner.stage.rollout))
    errored, scores = [], []
    for s in rollouts:
        try:
            scores.append(_sometimes_failing(runner.tok.decode(s.response_ids), {}))
            errored.append(False)
        except ConnectionError:
            scores.append(0.0)
            errored.append(True)
    finished = torch.tensor([s.finish_reason == "stop" for s in rollouts]).view(len(examples), G)
    made = runner.kind.make_batch(0, examples)
    batch, sums = made.batch, made.sums
    return (torch.tensor(errored).view(len(examples), G), torch.tensor(scores, dtype=torch.float64).view(len(examples), G),
            finished, batch.loss_mask.sum(1), batch.advantages, sums, runner.stage.rollout)


def test_failed_reward_leaves_the_loss_and_the_group_statistics(tmp_path):
    from megatron_cascade.algorithms import apply_overlong_policy, group_advantages, informative_groups

    errored, scores, finished, mask_rows, advantages, sums, r = run_distributed(
        _invalid_samples_worker, 1, str(tmp_path), timeout_s=240)[0]
    assert 0 < int(errored.sum()) < errored.numel(), "the test needs failed and scored samples"
    assert sums["samples/math"] - sums["scored/math"] == float(errored.sum())
    flat = errored.flatten()
    assert (mask_rows[flat] == 0).all(), "a sample whose reward failed must be out of the loss (and normaliser)"
    assert (advantages[flat] == 0).all()
    scores, keep = apply_overlong_policy(scores, finished, policy=r.overlong_policy)
    valid = keep & ~errored
    expected = group_advantages(scores, std_normalize=r.std_normalize_advantages, baseline=r.advantage_baseline,
                                std=r.advantage_std, valid=valid)
    torch.testing.assert_close(advantages, expected.flatten().float(), atol=1e-6, rtol=0)
    assert (advantages != 0).any(), "the test needs a group with signal"
    keep = valid & informative_groups(scores, valid=valid).unsqueeze(1)
    assert ((mask_rows > 0) <= keep.flatten()).all()
    assert (mask_rows[keep.flatten()] > 0).all()


def _outage_worker(tmp: str):
    from megatron_cascade.stages.rollout_scoring import RewardErrorRateExceeded

    runner = _runner(tmp, 0.5, _always_failing)
    before = [p.detach().clone() for p in runner.policy.module.parameters()]
    try:
        runner._step(0)
    except RewardErrorRateExceeded as e:
        message = str(e)
    else:
        message = None
    unchanged = all(torch.equal(a, p) for a, p in zip(before, runner.policy.module.parameters()))
    return message, unchanged


def test_reward_outage_stops_the_run_before_the_optimizer_step(tmp_path):
    message, unchanged = run_distributed(_outage_worker, 1, str(tmp_path), timeout_s=240)[0]
    assert message is not None, "a step whose every reward failed trained on zeros"
    assert "rewards.max_error_frac=0.5" in message and "16 of 16 samples" in message
    assert "math (reward math): 16/16" in message
    assert unchanged, "nothing may be trained on a step stopped for reward errors"


def _fails_on_rank_0(response: str, sample: dict) -> float:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ConnectionError("reward server unreachable from rank 0")
    return 1.0


def _one_rank_outage_worker(tmp: str):
    from megatron_cascade.stages.rollout_scoring import RewardErrorRateExceeded

    runner = _runner(tmp, 0.4, _fails_on_rank_0)
    try:
        runner._step(0)
    except RewardErrorRateExceeded as e:
        return str(e)
    return None


def test_error_fraction_is_global_over_data_parallel_ranks(tmp_path):
    """Rank 0's rewards all fail, rank 1's none: 8 of 16 globally > 0.4, so both ranks stop
    (rank 1 alone saw no error; without the all-reduce it would go on to a collective and hang)."""
    messages = run_distributed(_one_rank_outage_worker, 2, str(tmp_path), timeout_s=240)
    assert all(m is not None and "8 of 16 samples" in m and "rewards.max_error_frac=0.4" in m for m in messages), messages


def test_max_error_frac_out_of_range_is_a_config_error(tmp_path):
    from megatron_cascade.config import ConfigError, load_config

    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(tiny=TINY, out=tmp_path / "out", max_error_frac=1.5))
    with pytest.raises(ConfigError, match=r"rewards.max_error_frac=1.5 must be in \[0, 1\]"):
        load_config(str(config))
