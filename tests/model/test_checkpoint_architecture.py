"""The architecture check of a weights directory: checkpoints saved before a config field existed
still load (the field's default is what they were trained with), a runtime-only field never blocks a
load, and a real architecture change is refused with the key named."""

import json
from dataclasses import replace

import pytest

from megatron_cascade.config import ModelConfig, MoEConfig
from megatron_cascade.model.weights_checkpoint import MODEL_CONFIG_FILE, CheckpointError, architecture_of, check_architecture

MOE = ModelConfig(moe=MoEConfig(num_experts=4, router_topk=2))
# Fields added to MoEConfig after checkpoints were already written by earlier versions.
NEWER_MOE_FIELDS = ("router_score_function", "router_enable_expert_bias", "router_bias_update_rate")


def _write(folder, arch: dict) -> str:
    folder.mkdir()
    (folder / MODEL_CONFIG_FILE).write_text(json.dumps({"architecture": arch}))
    return str(folder)


def test_checkpoint_from_before_the_router_fields_loads(tmp_path):
    arch = architecture_of(MOE)
    for key in NEWER_MOE_FIELDS:
        arch["moe"].pop(key, None)
    check_architecture(_write(tmp_path / "old", arch), MOE)


def test_bias_update_rate_is_not_architecture(tmp_path):
    saved = replace(MOE, moe=replace(MOE.moe, router_bias_update_rate=0.5))
    check_architecture(_write(tmp_path / "rate", architecture_of(saved)), MOE)


@pytest.mark.parametrize("change", [{"router_enable_expert_bias": True, "router_score_function": "sigmoid"},
                                    {"router_score_function": "sigmoid"}, {"num_experts": 8}])
def test_architecture_change_is_named(tmp_path, change):
    saved = replace(MOE, moe=replace(MOE.moe, **change))
    with pytest.raises(CheckpointError, match=f"moe.{sorted(change)[0]}"):
        check_architecture(_write(tmp_path / "other", architecture_of(saved)), MOE)


def test_old_checkpoint_with_non_default_new_field_is_refused(tmp_path):
    """A checkpoint without the field was trained with its default: a model asking otherwise differs."""
    arch = architecture_of(MOE)
    arch["moe"].pop("router_score_function")
    wanted = replace(MOE, moe=replace(MOE.moe, router_score_function="sigmoid"))
    with pytest.raises(CheckpointError, match="moe.router_score_function: checkpoint='softmax'"):
        check_architecture(_write(tmp_path / "old", arch), wanted)
