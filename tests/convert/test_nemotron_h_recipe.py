"""examples/nemotron_cascade2/nemotron_3_nano: the model is what converting Nemotron-3-Nano-30B-A3B
gives, the stages are the recipe's, and the dry run plans the layout."""

from __future__ import annotations

from pathlib import Path

import re

import yaml
from test_nemotron_h_units import NANO

from megatron_cascade import cli
from megatron_cascade.config import load_config
from megatron_cascade.convert import model_config_from_hf
from megatron_cascade.model.weights_checkpoint import architecture_of

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "nemotron_cascade2"
NANO_CASCADE = RECIPE / "nemotron_3_nano" / "cascade.yaml"


def test_recipe_model_is_the_converted_checkpoints_architecture():
    cfg = load_config(str(NANO_CASCADE), check_paths=False)
    _, converted = model_config_from_hf(NANO, "nano/config.json")
    # recompute is a training choice (convert writes none): not part of the architecture a checkpoint
    # is checked against, so the converted weights load into the recipe's model.
    assert architecture_of(cfg.model) == architecture_of(converted)
    assert cfg.model.precision == converted.precision == "bf16"


def test_stages_are_the_recipes_but_for_nano_teachers():
    nano = yaml.safe_load(NANO_CASCADE.read_text())["stages"]
    qwen = yaml.safe_load((RECIPE / "cascade.yaml").read_text())["stages"]
    assert [s["name"] for s in nano] == [s["name"] for s in qwen]
    for a, b in zip(nano, qwen):
        if a["name"] == "mopd":
            ta, tb = a.pop("teachers"), b.pop("teachers")
            assert set(ta) == set(tb)
            assert all(ta[d] == tb[d] for d in ta if "/" not in tb[d])  # this run's stages
            assert ta["math"].startswith("/checkpoints/nemotron-3-nano")  # the SFT model
        assert a == b


def test_every_reward_scores_only_the_answer_after_the_reasoning():
    cfg = load_config(str(NANO_CASCADE), check_paths=False)
    parsers = {name: d.reward.reasoning_parser for name, d in cfg.domains.items()}
    assert all(p == "think" for name, p in parsers.items() if name != "swe"), parsers


def test_dry_run_plans_the_hybrid_layout(capsys):
    code = cli.main(["run", str(NANO_CASCADE), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "layout: TP=2 PP=4 CP=1 EP=8 ETP=1 DP=8 expert-DP=2 sequence_parallel=True" in out, out
    lines = out[out.index("stages:"):out.index("memory plan per GPU")].splitlines()[1:]
    stages = [line for line in lines if not line.strip().startswith("decode layout")]
    names = [s["name"] for s in yaml.safe_load(NANO_CASCADE.read_text())["stages"]]
    assert [line.split()[0] for line in stages] == names
    # Decoding at the training TP (the Mamba layers' split), without pipeline stages, EP as training.
    assert out.count("decode layout: TP=2 EP=8 ETP=1 DP=32") == len(names), out
    plans = [line for line in out[out.index("memory plan per GPU"):].splitlines()[1:] if "peak" in line]
    for line in plans:  # the recipe's targets: every stage within 80 GiB, >= 64 samples of room per GPU
        assert float(re.search(r"peak +([\d.]+) GiB", line).group(1)) <= 80, line
        assert int(re.search(r"room for (\d+)/GPU", line).group(1)) >= 64 or "code_rl" in line or "mopd" in line, line
