"""A resume notices data rewritten since its checkpoint (issue 29): the steps after it would draw other
rows than a run that never stopped. Refused naming the domain and the file, unless the run allows
``data.contents``."""

from __future__ import annotations

import os
import shutil

from megatron_cascade.testing import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny_cascade", "cascade.yaml")

CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 1, hidden_size: 32, ffn_hidden_size: 64}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 1}}
logging: {{progress_bar: false, tensorboard: false}}
domains: {{math: {{sft: {rows}}}}}
stages:
  - {{name: sft, type: sft, steps: 3, prompts_per_step: 4, domains: {{math: 1.0}}}}
"""


def _resume_worker(tmp: str) -> dict:
    from megatron_cascade.cascade.runner import build_context
    from megatron_cascade.cascade.stage import StageRunner
    from megatron_cascade.config import ConfigError, load_config, resolve_stage
    from megatron_cascade.model import initialize_model_parallel

    rows = os.path.join(tmp, "math_sft.jsonl")
    shutil.copy(os.path.join(REPO, "examples", "tiny_cascade", "data", "math_sft.jsonl"), rows)
    path = os.path.join(tmp, "run.yaml")
    with open(path, "w") as f:
        f.write(CONFIG.format(tiny=TINY, out=os.path.join(tmp, "out"), rows=rows))
    cfg = load_config(path)
    initialize_model_parallel(cfg.parallel, seed=cfg.seed)
    stage = resolve_stage(cfg, cfg.stages[0])

    def resume(allowed=()):
        try:
            return StageRunner(build_context(cfg, allowed_changes=allowed), 0, stage)._build()
        except ConfigError as exc:
            return f"ConfigError: {exc}"

    runner = StageRunner(build_context(cfg), 0, stage)
    runner._build()
    runner._maybe_checkpoint(1)  # a checkpoint at step 1
    out = {"unchanged": resume()}
    with open(rows, "a") as f:
        f.write('{"prompt": "1+1=", "response": "2", "answer": "2"}\n')
    out["changed"] = resume()
    out["allowed"] = resume(["data.contents"])
    return out


def test_resume_refuses_rewritten_data_unless_allowed(tmp_path):
    """Before: the run resumed on the rewritten file without a word (steps 1-2 on the old rows, 3+ on
    the new ones)."""
    got = run_distributed(_resume_worker, 1, str(tmp_path))[0]
    assert got["unchanged"] == 1 and got["allowed"] == 1, got
    assert got["changed"].startswith("ConfigError: stage sft: its checkpoint at step 1 was taken on other data: "
                                     "domains.math ("), got
    assert "--allow-config-change data.contents" in got["changed"], got
