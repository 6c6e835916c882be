"""``stages[i].init_from``: a stage starts from a named earlier stage's final weights (MOPD and GRPO
from the same weights), by default from the previous stage's; a name that is not an earlier stage is
refused when the config loads, naming the key."""

from pathlib import Path

import pytest

from megatron_cascade.cascade.manifest import Manifest
from megatron_cascade.cascade.stage import RunContext, start_weights
from megatron_cascade.config import ConfigError, load_config

CI = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade" / "ci.yaml")


def _context(tmp_path, *overrides):
    cfg = load_config(CI, [f"output_dir={tmp_path}", *overrides])
    manifest = Manifest(str(tmp_path))
    for stage in cfg.stages:
        manifest.record_stage(stage.name, {"status": "complete", "type": stage.type,
                                           "final_weights": f"stages/{stage.name}/final"})
    return RunContext(cfg, None, manifest, None, {}, {})


def test_default_is_the_previous_stage(tmp_path):
    ctx = _context(tmp_path)
    names = [s.name for s in ctx.cfg.stages]
    assert start_weights(ctx, names.index("mopd")) == str(tmp_path / "stages" / "math_rl" / "final")


def test_init_from_names_an_earlier_stage(tmp_path):
    ctx = _context(tmp_path, "stages.mopd.init_from=sft")
    names = [s.name for s in ctx.cfg.stages]
    assert start_weights(ctx, names.index("mopd")) == str(tmp_path / "stages" / "sft" / "final")


@pytest.mark.parametrize("name", ["code_rl", "mopd", "nope"])
def test_a_later_or_unknown_stage_is_refused(tmp_path, name):
    with pytest.raises(ConfigError, match=rf"stages\[3\] \(mopd\): init_from='{name}' is not an earlier stage"):
        load_config(CI, [f"output_dir={tmp_path}", f"stages.mopd.init_from={name}"])


def test_changing_a_started_stages_init_from_is_a_result_change(tmp_path):
    from megatron_cascade.cascade.resume_check import result_changes

    recorded = load_config(CI, [f"output_dir={tmp_path}"])
    now = load_config(CI, [f"output_dir={tmp_path}", "stages.mopd.init_from=sft"])
    changes = result_changes(recorded, now, ["mopd"], evaluated=False)
    assert [(c.key, c.recorded, c.now) for c in changes] == [("stages.mopd.init_from", None, "sft")]
    assert result_changes(recorded, now, ["if_rl"], evaluated=False) == []


@pytest.mark.slow
def test_a_run_records_init_from_and_the_periodic_evals(tmp_path):
    from cascade_fixtures import TINY, read_manifest, run_cli

    from megatron_cascade.cascade.report import eval_curves, format_table

    out = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(f"""
defaults: [{TINY}]
output_dir: {out}
model: {{num_layers: 1, hidden_size: 32, ffn_hidden_size: 64}}
rollout: {{max_new_tokens: 6}}
eval: {{max_prompts: 2, samples: 2, every_steps: 1}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false}}
stages:
  - {{name: sft, type: sft, steps: 2, prompts_per_step: 4, domains: {{math: 1.0}}}}
  - {{name: a, type: sft, steps: 1, prompts_per_step: 4, domains: {{math: 1.0}}}}
  - {{name: b, type: grpo, init_from: sft, steps: 2, prompts_per_step: 2, samples_per_prompt: 2,
      domains: {{math: 1.0}}}}
""")
    result = run_cli("run", str(config))
    assert result.returncode == 0, result.stdout[-4000:]
    manifest = read_manifest(str(out))
    assert manifest["stages"]["b"]["init_from"] == "sft" and manifest["stages"]["a"]["init_from"] == "sft"
    assert set(manifest["stages"]["b"]["eval_se"]) == set(manifest["stages"]["b"]["eval"])
    # b: an eval after step 1 of 2 (the stage's own domain only); its curve starts at sft's score
    curve = eval_curves(str(out))["b"]["math"]
    assert [step for step, _ in curve] == [0, 1, 2]
    assert curve[0][1] == manifest["stages"]["sft"]["eval"]["math"]
    assert curve[2][1] == manifest["stages"]["b"]["eval"]["math"]
    sft_records = (out / "stages" / "sft" / "metrics.jsonl").read_text()
    assert "eval/" not in sft_records  # SFT stages are not evaluated during training
    b_row = next(line for line in format_table(str(out)).splitlines() if line.startswith("b "))
    assert " sft " in b_row
