"""Real (seconds-long) CPU training runs: the losses actually teach a tiny GPT.

* GRPO: with reward = fraction of a target character in the response, the mean sampled reward rises
  from chance (~1/100) to a large fraction within a few dozen steps.
* MOPD: a student sampling from itself and trained with mopd_loss against a fixed, peaked teacher
  (a differently initialised model trained a few SFT steps on a target string) lowers the sampled
  reverse KL ``reverse_kl_mean`` reported by the train step.

Both run the full path: ``generate`` -> rewards / teacher ``forward_logprobs`` -> ``pack_rollouts``
-> ``train_step`` on a ``build_policy`` policy, in one gloo process with Megatron's CPU mode.
"""

import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed

TARGET = "a"
MODEL = dict(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, max_position_embeddings=64)


def _setup():
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.tokenizers import build_tokenizer

    tok = build_tokenizer("builtin:char")
    initialize_model_parallel(ParallelConfig(), seed=1234)
    return tok, ModelConfig(vocab_size=tok.vocab_size, **MODEL)


def _prompts(tok, n):
    return [tok.apply_chat_template([{"role": "user", "content": f"go {i}"}]) for i in range(n)]


def _train_batch(rollouts, tok, **extra):
    from megatron_cascade.rollout import pack_rollouts
    from megatron_cascade.training import TrainBatch

    packed = pack_rollouts(rollouts, pad_id=tok.pad_id)
    return TrainBatch(input_ids=packed.tokens, target_ids=packed.targets, loss_mask=packed.loss_mask,
                      inference_logprobs=packed.inference_logprobs, **extra)


def _grpo_worker(steps, prompts, group):
    from megatron_cascade.algorithms import group_advantages
    from megatron_cascade.rollout import SamplingParams, generate
    from megatron_cascade.training import LossSpec, build_policy, train_step

    tok, model_cfg = _setup()
    policy = build_policy(model_cfg, ParallelConfig(), OptimizerConfig(lr=1e-2), total_steps=steps)
    spec = LossSpec("grpo", LossConfig(), temperature=1.0, vocab_size=tok.vocab_size)
    training = TrainingConfig(micro_batch_size=prompts * group)
    mean_rewards = []
    for step in range(steps):
        params = SamplingParams(temperature=1.0, max_new_tokens=8, n=group, seed=step, ignore_eos=True)
        rollouts = generate(policy.module, _prompts(tok, prompts), params, tokenizer=tok)
        texts = [tok.decode(s.response_ids) for s in rollouts]
        rewards = torch.tensor([t.count(TARGET) / max(len(t), 1) for t in texts]).view(prompts, group)
        batch = _train_batch(rollouts, tok, advantages=group_advantages(rewards).reshape(-1))
        metrics = train_step(policy, batch, spec, training)
        assert metrics["skipped"] == 0.0
        mean_rewards.append(float(rewards.mean()))
    return mean_rewards


def test_grpo_raises_the_mean_reward_of_a_trivially_rewardable_task():
    rewards = run_distributed(_grpo_worker, 1, 30, 4, 8)[0]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1, rewards
    assert last > 0.5 and last > first + 0.4, rewards


def _mopd_worker(steps):
    from megatron_cascade.rollout import SamplingParams, generate
    from megatron_cascade.training import LossSpec, TrainBatch, build_policy, forward_logprobs, train_step

    tok, model_cfg = _setup()
    # The teacher: another initialisation, SFT-trained to answer "hello" to every prompt.
    teacher = build_policy(model_cfg, ParallelConfig(), OptimizerConfig(lr=1e-2), total_steps=20)
    prompt = _prompts(tok, 1)[0]
    seq = prompt + tok.encode("hello") + [tok.eos_id]
    ids = torch.tensor([seq])
    targets = torch.full_like(ids, tok.pad_id)
    targets[:, :-1] = ids[:, 1:]
    mask = torch.zeros(ids.shape)
    mask[:, len(prompt) - 1:len(seq) - 1] = 1.0
    sft = LossSpec("sft", LossConfig(), vocab_size=tok.vocab_size)
    for _ in range(20):
        train_step(teacher, TrainBatch(input_ids=ids, target_ids=targets, loss_mask=mask), sft,
                   TrainingConfig(micro_batch_size=1))

    student = build_policy(model_cfg, ParallelConfig(), OptimizerConfig(lr=3e-2), total_steps=steps)
    spec = LossSpec("mopd", LossConfig(), temperature=1.0, vocab_size=tok.vocab_size)
    training = TrainingConfig(micro_batch_size=16)
    reverse_kl = []
    for step in range(steps):
        params = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=step)
        rollouts = generate(student.module, _prompts(tok, 4), params, tokenizer=tok)
        batch = _train_batch(rollouts, tok)
        batch.teacher_logprobs = forward_logprobs(teacher.chunks, batch, spec, training.micro_batch_size)
        metrics = train_step(student, batch, spec, training)
        assert metrics["skipped"] == 0.0
        reverse_kl.append(metrics["reverse_kl_mean"])
    return reverse_kl


def test_mopd_lowers_the_sampled_reverse_kl_to_a_fixed_teacher():
    kl = run_distributed(_mopd_worker, 1, 20)[0]
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert first > 1.0, kl
    assert last < 0.6 * first, kl
