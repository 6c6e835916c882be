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
