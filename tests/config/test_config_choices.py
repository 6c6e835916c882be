"""Choices are ``str`` enums of the schema: OmegaConf refuses other values when the YAML is merged,
``config.yaml`` round-trips with the strings users write, and code comparing with strings works."""

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from megatron_cascade.config import (
    Choice, ConfigError, LossConfig, ModelConfig, OptimizerConfig, RunConfig, load_config, to_yaml, validate_tree,
)
from megatron_cascade.config.model import Precision
from megatron_cascade.config.schema import OverlongPolicy

CI = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade" / "ci.yaml")

BAD_CHOICES = [
    ("loss.importance_correction=clip", r"loss.importance_correction='clip' is not one of \['icepop', 'truncate', "
                                        r"'none'\]"),
    ("loss.mopd_normalization=batch", r"loss.mopd_normalization='batch' is not one of"),
    ("rollout.overlong_policy=drop", r"rollout.overlong_policy='drop' is not one of \['zero', 'mask'\]"),
    ("rollout.advantage_baseline=median", r"rollout.advantage_baseline='median' is not one of"),
    ("rollout.advantage_std=bessel", r"rollout.advantage_std='bessel' is not one of \['sample', 'population'\]"),
    ("data.on_bad_row=ignore", r"data.on_bad_row='ignore' is not one of \['skip', 'error'\]"),
    ("optimizer.lr_decay_style=step", r"optimizer.lr_decay_style='step' is not one of"),
    ("model.precision=fp64", r"model.precision='fp64' is not one of \['fp32', 'bf16', 'fp16'\]"),
    ("model.recompute=partial", r"model.recompute='partial' is not one of"),
    ("model.fp8.format=e5m2", r"model.fp8.format='e5m2' is not one of \['e4m3', 'hybrid'\]"),
    ("model.moe.token_dispatcher_type=ring", r"model.moe.token_dispatcher_type='ring' is not one of"),
]


def _nested(key: str, value: str) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize("override,message", BAD_CHOICES, ids=[o for o, _ in BAD_CHOICES])
def test_a_value_outside_a_choice_is_refused_at_load_naming_file_and_key(tmp_path, override, message):
    path = tmp_path / "mine.yaml"
    path.write_text(f"defaults: [{CI}]\n" + yaml.safe_dump(_nested(*override.split("="))))
    with pytest.raises(ConfigError, match=r"mine\.yaml: " + message):
        load_config(str(path), check_paths=False)
    with pytest.raises(ConfigError, match=f"command-line override '{override}': " + message):
        load_config(CI, [override], check_paths=False)


def test_a_stage_override_outside_a_choice_names_the_stage():
    with pytest.raises(ConfigError, match=r"ci\.yaml: stage 'if_rl': rollout.overlong_policy='drop' is not one of"):
        load_config(CI, ["stages.if_rl.rollout.overlong_policy=drop"], check_paths=False)


def test_choice_fields_are_enums_and_compare_as_the_strings_users_write():
    cfg = load_config(CI, ["rollout.overlong_policy=mask", "model.precision=bf16"], check_paths=False)
    policy, precision = cfg.rollout.overlong_policy, cfg.model.precision
    assert policy is OverlongPolicy.mask and precision is Precision.bf16
    assert policy == "mask" and policy != "zero" and policy in ("mask",) and {"mask": 1}[policy] == 1
    assert (str(policy), f"{policy}", f"{policy:>5}", repr(precision)) == ("mask", "mask", " mask", "'bf16'")
    assert json.dumps({"p": precision}) == '{"p": "bf16"}'


def test_config_yaml_round_trips_with_plain_strings(tmp_path):
    cfg = load_config(CI, ["rollout.advantage_baseline=leave_one_out", "loss.importance_correction=truncate"],
                      check_paths=False)
    text = to_yaml(cfg)
    assert "advantage_baseline: leave_one_out\n" in text and "importance_correction: truncate\n" in text
    assert "!!python" not in text and "Choice" not in text
    saved = tmp_path / "config.yaml"
    saved.write_text(text)
    assert load_config(str(saved), check_paths=False) == cfg


def test_every_choice_member_name_is_its_value():
    """OmegaConf reads a YAML string as a member *name*: a name differing from its value could not be written."""
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    enums = list(subclasses(Choice))
    assert len(enums) >= 16
    assert [(e.__name__, m.name) for e in enums for m in e if m.name != m.value] == []


def test_a_config_built_in_code_is_checked_too():
    with pytest.raises(ConfigError, match=r"model.precision='fp64' is not one of"):
        validate_tree(ModelConfig(precision="fp64"), "model.")
    with pytest.raises(ConfigError, match=r"optimizer.lr_decay_style='step' is not one of"):
        validate_tree(OptimizerConfig(lr_decay_style="step"), "optimizer.")
    validate_tree(LossConfig(importance_correction="truncate"), "loss.")  # plain strings are fine
    validate_tree(RunConfig(), "")


def test_no_choice_is_left_a_free_string():
    """The fields documented as ``a | b`` are typed by an enum (the stage type is a registry, not a choice)."""
    free = []
    for cls in (ModelConfig, OptimizerConfig, LossConfig, *[f.type for f in dataclasses.fields(RunConfig)
                                                            if isinstance(f.type, type)]):
        for name, hint in typing.get_type_hints(cls).items():
            if hint is str and name not in ("output_dir", "tokenizer", "name", "type"):
                free.append(f"{cls.__name__}.{name}")
    assert free == []


def test_loading_a_config_imports_neither_training_nor_torch():
    code = (f"import sys; from megatron_cascade.config import load_config; load_config({CI!r}, check_paths=False); "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('megatron_cascade.training', "
            "'megatron.core'))); print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
