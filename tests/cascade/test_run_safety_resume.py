"""A resume runs the config it was started with, or says what changed.

The run directory's ``config.yaml`` is the config the run was started with. A resume whose resolved
config changes what a started stage computes (seed, data, model, loss, optimizer, the stage's own
settings, or evaluation once a stage has been scored) is refused, naming every such key, unless
``--allow-config-change`` names it; accepted changes are recorded in ``manifest.json``. Adding stages,
changing stages that have not started and execution settings (checkpoint cadence, parallel layout,
logging) stay free. Before: a resume with another ``seed`` or ``lr`` trained on silently (exit 0) and
``config.yaml`` then claimed values the finished steps never used. ``run --dry-run`` reports the
same check without running or writing.
"""

from __future__ import annotations

import os

import pytest
import yaml
from cascade_fixtures import TINY, read_manifest, run_cli

from megatron_cascade.cascade.manifest import Manifest
from megatron_cascade.cascade.resume_check import check_resume
from megatron_cascade.config import ConfigError, load_config, to_yaml
from megatron_cascade.training.resume_checkpoint import read_latest

CONFIG = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 1, hidden_size: 32, ffn_hidden_size: 64}}
training: {{micro_batch_size: 8}}
eval: {{enabled: false}}
checkpoint: {{every_steps: 0, keep_last: 2}}
logging: {{progress_bar: false, tensorboard: false}}
stages:
  - {{name: sft, type: sft, steps: 2, prompts_per_step: 8, domains: {{math: 1.0}}}}
{more}"""
APPENDED = "  - {name: sft2, type: sft, steps: 1, prompts_per_step: 8, domains: {math: 1.0}}\n"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
    """A run stopped (time limit) after its first step: stage sft has a checkpoint at step 1."""
    import time

    folder = tmp_path_factory.mktemp("resume")
    out = str(folder / "run")
    config = folder / "c.yaml"
    config.write_text(CONFIG.format(tiny=TINY, out=out, more=""))
    env = _env(SLURM_JOB_ID="4242", SLURM_JOB_END_TIME=str(int(time.time()) + 3600))
    first = run_cli("run", str(config), "checkpoint.time_limit_margin_s=3600", env=env, timeout=300)
    assert first.returncode == 75, first.stdout[-3000:]
    assert read_latest(os.path.join(out, "stages", "sft", "checkpoints")).endswith("step_00000001")
    return folder, str(config), out


@pytest.mark.slow
def test_resume_with_another_seed_or_lr_is_refused_naming_the_keys(partial_run):
    _, config, out = partial_run
    refused = run_cli("run", config, "seed=7", "optimizer.lr=0.5", env=_env(), timeout=300)
    assert refused.returncode == 2, refused.stdout[-3000:]
    for text in ("seed: 1234 -> 7", "stages.sft.optimizer.lr: 0.0003 -> 0.5",
                 "--allow-config-change seed,stages.sft.optimizer.lr"):
        assert text in refused.stdout, refused.stdout[-3000:]
    with open(os.path.join(out, "config.yaml")) as f:  # the record still says what the run used
        recorded = yaml.safe_load(f)
    assert recorded["seed"] == 1234 and recorded["optimizer"]["lr"] == 3e-4


@pytest.mark.slow
def test_an_allowed_change_resumes_and_is_recorded_then_an_appended_stage_runs(partial_run):
    folder, config, out = partial_run
    allowed = run_cli("run", config, "seed=7", "--allow-config-change", "seed", env=_env(), timeout=300)
    assert allowed.returncode == 0, allowed.stdout[-3000:]
    assert "resuming from" in allowed.stdout and "(step 1)" in allowed.stdout, allowed.stdout[-3000:]
    change = read_manifest(out)["config_changes"][-1]
    assert change["allowed"] == ["seed"] and change["changes"] == {"seed": {"recorded": 1234, "now": 7}}, change
    with open(os.path.join(out, "config.yaml")) as f:
        assert yaml.safe_load(f)["seed"] == 7
    # A stage appended to the finished run: no flag needed; the requeue-style repeated flag is harmless.
    longer = folder / "longer.yaml"
    longer.write_text(CONFIG.format(tiny=TINY, out=out, more=APPENDED))
    appended = run_cli("run", str(longer), "seed=7", "--allow-config-change=seed", env=_env(), timeout=300)
    assert appended.returncode == 0, appended.stdout[-3000:]
    assert "stage sft is complete; skipping" in appended.stdout, appended.stdout[-3000:]
    manifest = read_manifest(out)
    assert manifest["stages"]["sft2"]["status"] == "complete"
    assert len(manifest["config_changes"]) == 1  # nothing changed the second time: nothing recorded


# -- the comparison itself (no training: a recorded config and a manifest) ---------------------------------

UNIT = """
defaults: [{tiny}]
output_dir: {out}
stages:
  - {{name: sft, type: sft, steps: 3, prompts_per_step: 8, domains: {{math: 1.0}}, optimizer: {{lr: 0.001}}}}
  - {{name: rl, type: grpo, steps: 3, prompts_per_step: 4, domains: {{instruction_following: 1.0}}}}
"""


@pytest.fixture
def recorded(tmp_path):
    """A run whose stage sft is complete (rl not started), recorded as the runner records it."""
    out = str(tmp_path / "run")
    path = tmp_path / "c.yaml"
    path.write_text(UNIT.format(tiny=TINY, out=out))
    cfg = load_config(str(path))
    os.makedirs(out)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    Manifest(out).record_stage("sft", {"status": "complete", "final_weights": "stages/sft/final"})
    return str(path)


def _check(config: str, *overrides: str, allowed: tuple[str, ...] = ()):
    return check_resume(load_config(config, list(overrides)), allowed)


def test_changes_that_do_not_touch_a_started_stage_are_free(recorded):
    assert _check(recorded, "stages.rl.steps=9", "stages.rl.rollout.temperature=0.5") == []
    assert _check(recorded, "optimizer.lr=0.5") == []  # sft has its own lr; only rl (not started) uses it
    assert _check(recorded, "checkpoint.every_steps=1", "parallel.use_distributed_optimizer=true",
                  "logging.tensorboard=false", "distributed.timeout_minutes=5", "model.recompute=full") == []


def test_started_stage_settings_model_data_and_eval_are_refused(recorded):
    with pytest.raises(ConfigError) as exc:
        _check(recorded, "stages.sft.steps=5", "stages.sft.optimizer.lr=0.5", "model.hidden_size=32",
               "eval.max_prompts=3", "domains.math.train=/elsewhere.jsonl")
    text = str(exc.value)
    demo_max_prompts = load_config(recorded).eval.max_prompts  # follows the demo config
    for line in ("stages.sft.steps: 3 -> 5", "stages.sft.optimizer.lr: 0.001 -> 0.5", "model.hidden_size: ",
                 f"eval.max_prompts: {demo_max_prompts} -> 3", "domains.math.train: "):
        assert line in text, text


def test_a_stage_inserted_before_a_started_one_is_refused(tmp_path, recorded):
    text = open(recorded).read().replace("stages:\n", "stages:\n  - {name: pre, type: sft, steps: 1, "
                                                      "prompts_per_step: 8, domains: {math: 1.0}}\n")
    path = tmp_path / "inserted.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"stages: \['sft', 'rl'\] -> \['pre', 'sft', 'rl'\]"):
        check_resume(load_config(str(path)), ())


def test_allowed_keys_cover_their_subkeys_and_the_stage_relative_name(recorded):
    changes = _check(recorded, "stages.sft.optimizer.lr=0.5", "seed=3", allowed=("optimizer.lr", "seed"))
    assert {c.key for c in changes} == {"stages.sft.optimizer.lr", "seed"}
    with pytest.raises(ConfigError, match="model.num_layers"):
        _check(recorded, "model.num_layers=3", "seed=3", allowed=("seed",))
    assert [c.key for c in _check(recorded, "model.num_layers=3", allowed=("model",))] == ["model.num_layers"]


def test_a_dry_run_reports_the_resume_check_without_running(recorded, capsys):
    from megatron_cascade.cli import main

    dry = ["run", recorded, "--dry-run", "cluster.gpus_per_node=1", "stages.sft.steps=5"]
    assert main(dry) == 2
    assert "stages.sft.steps: 3 -> 5" in capsys.readouterr().err
    assert main([*dry, "--allow-config-change", "stages.sft"]) == 0
    assert "--allow-config-change accepts stages.sft.steps: 3 -> 5" in capsys.readouterr().out
    assert "config_changes" not in read_manifest(os.path.join(os.path.dirname(recorded), "run"))  # nothing written


def test_eval_settings_are_free_while_eval_is_off_and_sft_reads_no_sampling_or_loss_settings(tmp_path):
    out = str(tmp_path / "run")
    path = tmp_path / "c.yaml"
    path.write_text(UNIT.format(tiny=TINY, out=out) + "eval: {enabled: false}\n")
    os.makedirs(out)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(to_yaml(load_config(str(path))))
    Manifest(out).record_stage("sft", {"status": "complete", "final_weights": "stages/sft/final"})
    # Nor does the finished sft stage read sampling or loss settings (only the rl stage, not started, does).
    assert check_resume(load_config(str(path), ["eval.max_prompts=3", "rollout.max_new_tokens=20",
                                                "loss.kl_coef=0.1"]), ()) == []
    with pytest.raises(ConfigError, match="eval.enabled: False -> True"):  # enabling it would mix the table
        check_resume(load_config(str(path), ["eval.enabled=true"]), ())
