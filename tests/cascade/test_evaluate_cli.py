"""``megatron-cascade eval`` runs the weights as training ran them: a bf16 run's model inside
Float16Module (its norms in bf16 too), so its log-probs equal the policy's (what the in-training evaluation runs)."""

import os

import torch

from megatron_cascade.testing import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny_cascade", "cascade.yaml")
CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 1, hidden_size: 32, ffn_hidden_size: 64, precision: bf16}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: sft, type: sft, steps: 1, prompts_per_step: 8, domains: {{math: 1.0}}}}
"""


def _worker(tmp):
    from megatron_cascade.cascade.evaluate_cli import eval_model
    from megatron_cascade.cascade.runner import build_context
    from megatron_cascade.cascade.stage import StageRunner
    from megatron_cascade.config import load_config, resolve_stage
    from megatron_cascade.config.training import LossConfig
    from megatron_cascade.model import initialize_model_parallel, save_model_weights
    from megatron_cascade.training import LossSpec, TrainBatch, forward_logprobs

    path = os.path.join(tmp, "c.yaml")
    with open(path, "w") as f:
        f.write(CONFIG.format(tiny=TINY, out=os.path.join(tmp, "out")))
    cfg = load_config(path)
    initialize_model_parallel(cfg.parallel, seed=cfg.seed)
    runner = StageRunner(build_context(cfg), 0, resolve_stage(cfg, cfg.stages[0]))
    runner._build()
    weights = os.path.join(tmp, "w")
    save_model_weights(runner.policy.module, weights, cfg.model)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(input_ids=ids[:, :-1], target_ids=ids[:, 1:], loss_mask=torch.ones(2, 8))
    spec = LossSpec("sft", LossConfig())
    model = eval_model(cfg, weights)
    return (forward_logprobs(runner.policy.chunks, batch, spec, 2), forward_logprobs([model], batch, spec, 2),
            {str(p.dtype) for p in model.parameters()})


def test_eval_model_runs_at_the_training_precision(tmp_path):
    stage_lp, eval_lp, dtypes = run_distributed(_worker, 1, str(tmp_path))[0]
    # Before: the local spec's norms stayed fp32 in an otherwise bf16 model (not what a GPU run holds).
    torch.testing.assert_close(eval_lp, stage_lp, atol=0, rtol=0)
    assert dtypes == {"torch.bfloat16"}
