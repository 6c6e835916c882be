"""A stage's lineage: the stages its final weights come from (start chain and MOPD teachers)."""

from pathlib import Path

import pytest

from megatron_cascade.config import ConfigError, load_config
from megatron_cascade.config.lineage import rl_samples_per_domain, stage_lineage

CASCADE = Path(__file__).parents[2] / "examples" / "tiny_cascade" / "cascade.yaml"


def test_the_lineage_follows_starts_and_teachers_not_the_comparison():
    cfg = load_config(str(CASCADE))
    assert stage_lineage(cfg, "mopd") == ["sft", "if_rl", "math_rl", "code_rl", "mopd"]  # its teachers are on the chain
    assert stage_lineage(cfg, "code_rl") == ["sft", "if_rl", "math_rl", "code_rl"]
    assert stage_lineage(cfg, "grpo_ref") == ["sft", "if_rl", "math_rl", "code_rl", "grpo_ref"]  # no teachers
    assert stage_lineage(cfg, "math_rl") == ["sft", "if_rl", "math_rl"]  # starts from the previous stage
    with pytest.raises(ConfigError, match="'nope' is not in this run"):
        stage_lineage(cfg, "nope")
    from_sft = load_config(str(CASCADE), ["stages.4.init_from=sft"])
    assert stage_lineage(from_sft, "mopd") == ["sft", "if_rl", "math_rl", "code_rl", "mopd"]  # through its teachers


def test_rl_samples_split_each_stage_by_its_domain_weights_and_skip_sft():
    cfg = load_config(str(CASCADE))
    # mopd: 40 steps x 64 prompts x 4 samples = 10,240 responses, 1 : 1 : 0.5; the sft stage samples none.
    assert rl_samples_per_domain(cfg, ["sft", "mopd"]) == {"math": 4096, "instruction_following": 4096, "code": 2048}
    assert rl_samples_per_domain(cfg, ["sft"]) == {}
