"""bf16 / fp16 training on CPU through Megatron's mixed-precision optimizer (fp32 master weights).

* A bf16 stage warm-started from saved weights trains from them: its fp32 masters are reloaded
  after the load (without that, the first step copies the build-time random init back).
* The whole model runs in bf16 (``Float16Module``: norms too) and log-probs come out in fp32.
* fp16: the schedule scales the loss by the optimizer's loss scale (gradients equal fp32's), and an
  overflowing scale skips steps and is lowered until steps go through.
* The GRPO / MOPD gradient stays invariant to the batch split in bf16 (DP=2, TP=2 vs one rank), at
  bf16 tolerance.
"""

import os
from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.testing.checkpoints import full_state_dict, save_gradients_as_checkpoint

pytestmark = pytest.mark.distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny_cascade", "cascade.yaml")
MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                    ffn_hidden_size=64)
BATCH, SEQ, VOCAB = 8, 24, 100

WARM_START = """
defaults: [{tiny}]
output_dir: {out}
init_checkpoint: {init}
model: {{num_layers: 1, hidden_size: 32, ffn_hidden_size: 64, precision: bf16}}
optimizer: {{lr: 1.0e-3}}
training: {{micro_batch_size: 8}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: sft, type: sft, steps: 2, prompts_per_step: 8, domains: {{math: 1.0}}, optimizer: {{lr: 1.0e-3}}}}
"""


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """All parameters of ``model`` as one fp32 vector (a copy)."""
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _warm_start_worker(tmp):
    from megatron_cascade.cascade.runner import build_context
    from megatron_cascade.cascade.stage import StageRunner
    from megatron_cascade.config import load_config, resolve_stage
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, save_model_weights
    from megatron_cascade.training import LossSpec, TrainBatch, forward_logprobs

    config = os.path.join(tmp, "warm.yaml")
    with open(config, "w") as f:
        f.write(WARM_START.format(tiny=TINY, out=os.path.join(tmp, "out"), init=os.path.join(tmp, "init")))
    cfg = load_config(config)
    initialize_model_parallel(cfg.parallel, seed=cfg.seed)
    torch.manual_seed(99)  # the "pretrained" weights: another initialisation than the stage's
    save_model_weights(build_gpt_model(cfg.model, cfg.parallel), os.path.join(tmp, "init"), cfg.model)
    runner = StageRunner(build_context(cfg), 0, resolve_stage(cfg, cfg.stages[0]))
    runner._build()
    loaded = _flat(runner.policy.module)
    dtypes = {str(p.dtype) for p in runner.policy.chunks[0].parameters()}
    ids = torch.randint(0, 50, (2, 9))
    batch = TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=torch.ones(2, 8))
    logprobs = forward_logprobs(runner.policy.chunks, batch, LossSpec("sft", LossConfig()), 2)
    for step in range(runner.stage.steps):
        runner._step(step)
    trained = _flat(runner.policy.module)
    # The policy the stage would start from without the load: same seed, fresh build.
    from megatron_cascade.cascade.stage import _reseed

    _reseed(cfg.seed)
    fresh = _flat(build_gpt_model(cfg.model, cfg.parallel))
    return loaded, trained, fresh, dtypes, logprobs.dtype


def test_bf16_warm_start_trains_from_the_loaded_weights(tmp_path):
    loaded, trained, fresh, dtypes, logprob_dtype = run_distributed(_warm_start_worker, 1, str(tmp_path))[0]
    assert dtypes == {"torch.bfloat16"}, "Float16Module casts every parameter (norms too) to bf16"
    assert logprob_dtype == torch.float32
    change = float((trained - loaded).norm() / loaded.norm())
    init_gap = float((loaded - fresh).norm() / loaded.norm())
    # Two Adam steps at lr 1e-3 move the weights ~2% (relative); a snap back to the stage's random
    # init moves them by the whole gap between the two initialisations (~35%: the norm weights agree).
    assert change < 0.2 * init_gap, f"relative change from the loaded weights {change:.3f}, init gap {init_gap:.3f}"


def _fp16_worker(precision, optim, steps):
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, TrainBatch, build_policy, train_step

    initialize_model_parallel(ParallelConfig(), seed=7)
    policy = build_policy(replace(MODEL, precision=precision), ParallelConfig(), optim, total_steps=100)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 17), generator=gen)
    batch = TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=torch.ones(4, 16))
    spec = LossSpec("sft", LossConfig(), vocab_size=VOCAB)
    start = _flat(policy.module)
    metrics = [train_step(policy, batch, spec, TrainingConfig(micro_batch_size=2)) for _ in range(steps)]
    return metrics, float((_flat(policy.module) - start).norm())


def test_fp16_loss_is_scaled_so_gradients_match_fp32():
    optim = OptimizerConfig(lr=1e-3, clip_grad=0.0)
    fp32 = run_distributed(_fp16_worker, 1, "fp32", optim, 1)[0][0][0]
    fp16 = run_distributed(_fp16_worker, 1, "fp16", optim, 1)[0][0][0]
    assert fp16["skipped"] == 0.0 and fp16["loss_scale"] == 65536.0
    # Unscaled losses would give gradients 1/65536 of fp32's (the optimizer divides by the scale).
    assert abs(fp16["grad_norm"] / fp32["grad_norm"] - 1) < 0.02, (fp16["grad_norm"], fp32["grad_norm"])


def test_fp16_overflow_skips_steps_and_lowers_the_loss_scale_until_steps_go_through():
    optim = OptimizerConfig(lr=1e-3, initial_loss_scale=2.0**40, hysteresis=1)
    metrics, moved = run_distributed(_fp16_worker, 1, "fp16", optim, 30)[0]
    skipped = [m["skipped"] for m in metrics]
    scales = [m["loss_scale"] for m in metrics]
    assert skipped[0] == 1.0, "a 2^40 loss scale overflows fp16"
    assert scales[-1] < 2.0**40 and sum(skipped) < len(skipped), (skipped, scales)
    assert skipped[-5:] == [0.0] * 5, (skipped, scales)
    assert moved > 0


def test_loss_scale_keys_are_refused_without_fp16():
    from megatron_cascade.config import ConfigError
    from megatron_cascade.config.training import validate_optimizer_config

    with pytest.raises(ConfigError, match=r"optimizer.initial_loss_scale.*model.precision=fp16 only"):
        validate_optimizer_config(OptimizerConfig(initial_loss_scale=1024.0), MODEL)


# --- bf16 gradient invariance -----------------------------------------------------------------------------

BF16 = replace(MODEL, precision="bf16")


def _global_batch():
    from megatron_cascade.testing.batches import UNEVEN_SPANS, random_rl_batch

    return random_rl_batch(UNEVEN_SPANS, SEQ, VOCAB)


def _gradient_worker(parallel, micro_batch_size, kind, weights_dir, grads_dir, init):
    from megatron.core import parallel_state as ps

    from megatron_cascade.model import initialize_model_parallel, save_model_weights
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.policy import load_policy_weights
    from megatron_cascade.training.step import compute_gradients

    initialize_model_parallel(parallel, seed=11)
    policy = build_policy(BF16, parallel, OptimizerConfig(lr=1e-3), total_steps=10)
    if init:
        save_model_weights(policy.module, weights_dir, BF16)
    else:
        load_policy_weights(policy, weights_dir)
    batch = _global_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = batch.select(slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp))
    loss = LossConfig(kl_coef=0.1, importance_correction="icepop", is_low=0.05, is_high=50.0)
    spec = LossSpec(kind, loss, temperature=0.7, vocab_size=VOCAB)
    metrics = compute_gradients(policy, share, spec, TrainingConfig(micro_batch_size=micro_batch_size))
    # main_grad (fp32) rounded to the bf16 parameters it is written into: at bf16 tolerance anyway.
    save_gradients_as_checkpoint(policy.module, grads_dir, BF16)
    return metrics, {k: v.float() for k, v in full_state_dict(BF16, grads_dir).items()}


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bf16_invariance"))
    out = {"tmp": tmp}
    for kind in ("grpo", "mopd"):
        out[kind] = run_distributed(_gradient_worker, 1, ParallelConfig(), BATCH, kind, f"{tmp}/w",
                                    f"{tmp}/ref_{kind}", kind == "grpo")[0]
    return out


BF16_SPLITS = [
    ("dp2", ParallelConfig(), 2),
    ("tp2", ParallelConfig(tensor_model_parallel_size=2), 4),
]


@pytest.mark.parametrize("kind", ["grpo", "mopd"])
@pytest.mark.parametrize("name,parallel,mbs", BF16_SPLITS, ids=[s[0] for s in BF16_SPLITS])
def test_bf16_gradient_is_invariant_to_the_split(bf16_reference, kind, name, parallel, mbs):
    ref_metrics, ref_grads = bf16_reference[kind]
    tmp = bf16_reference["tmp"]
    metrics, grads = run_distributed(_gradient_worker, 2, parallel, mbs, kind, f"{tmp}/w", f"{tmp}/{name}_{kind}",
                                     False)[0]
    assert metrics["tokens"] == ref_metrics["tokens"] == 66
    assert abs(metrics["loss"] - ref_metrics["loss"]) < 2e-2 * max(1.0, abs(ref_metrics["loss"]))
    for key, ref in ref_grads.items():
        # bf16 keeps 8 mantissa bits: per tensor, 3% of its largest entry (a missing 1/DP, or a
        # micro-batch counted twice, is an error of 50-100%).
        scale = float(ref.abs().max())
        err = float((grads[key] - ref).abs().max())
        assert err <= 3e-2 * scale + 1e-6, f"{key}: max error {err:.3g} vs largest gradient {scale:.3g}"
    assert sum(int(g.abs().sum() > 0) for g in ref_grads.values()) > len(ref_grads) // 2
