"""Every bad value is refused when the YAML is loaded, with the file, the full key and the reason.

The rules live on the schema's fields (``config.rules.ranged`` / ``checked``) and in each section's
``validate``; these cases are the ones a careless user (or the hardening review, issue 13) wrote.
"""

import dataclasses
import typing
from pathlib import Path

import re

import pytest

from megatron_cascade.config import ConfigError, RunConfig, load_config
from megatron_cascade.config.rules import _RULE

CI = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade" / "ci.yaml")

BAD = [
    # sampling parameters of training rollouts (the trainer divides the logits by the temperature)
    ("rollout.temperature=-1", r"rollout.temperature=-1.0 must be > 0"),
    ("rollout.temperature=0", r"rollout.temperature=0.0 must be > 0 \(the trainer divides the logits by it"),
    ("rollout.top_p=7", r"rollout.top_p=7.0 must be in \(0, 1\]"),
    ("rollout.top_p=0", r"rollout.top_p=0.0 must be in \(0, 1\]"),
    ("rollout.top_k=-1", r"rollout.top_k=-1 must be >= 0"),
    ("rollout.max_new_tokens=0", r"rollout.max_new_tokens=0 must be >= 1"),
    ("rollout.stop_strings=['</s>', '']", r"rollout.stop_strings=\['</s>', ''\] must not contain an empty string"),
    ("rollout.dynamic_sampling_max_rounds=0", r"rollout.dynamic_sampling_max_rounds=0 must be >= 1"),
    # evaluation
    ("eval.samples=0", r"eval.samples=0 must be >= 1"),
    ("eval.temperature=-0.5", r"eval.temperature=-0.5 must be >= 0"),
    (("eval.temperature=0", "eval.samples=4"), r"eval.samples=4 with eval.temperature=0 scores the same greedy answer"),
    ("eval.max_prompts=0", r"eval.max_prompts=0 must be >= 1"),
    ("eval.max_new_tokens=0", r"eval.max_new_tokens=0 must be >= 1"),
    ("eval.max_new_tokens=4096", r"eval.max_new_tokens=4096 leaves no room for the prompt"),
    # optimizer and loss
    ("optimizer.lr=-1e-3", r"optimizer.lr=-0.001 must be >= 0"),
    ("optimizer.lr=.nan", r"optimizer.lr=nan must be a finite number"),
    ("optimizer.weight_decay=-0.1", r"optimizer.weight_decay=-0.1 must be >= 0"),
    ("optimizer.clip_grad=-1", r"optimizer.clip_grad=-1.0 must be >= 0"),
    ("optimizer.adam_beta2=1.0", r"optimizer.adam_beta2=1.0 must be in \[0, 1\)"),
    ("optimizer.adam_eps=0", r"optimizer.adam_eps=0.0 must be > 0"),
    ("optimizer.lr_decay_steps=0", r"optimizer.lr_decay_steps=0 must be >= 1"),
    ("optimizer.min_lr=1", r"optimizer.min_lr=1.0 must be in \[0, optimizer.lr="),
    ("loss.clip_eps_low=0", r"loss.clip_eps_low=0.0 must be in \(0, 1\)"),
    ("loss.clip_eps_high=-0.2", r"loss.clip_eps_high=-0.2 must be > 0"),
    ("loss.kl_coef=-0.03", r"loss.kl_coef=-0.03 must be >= 0"),
    ("loss.is_low=1.5", r"loss.is_low=1.5 must be in \[0, 1\]"),
    ("loss.is_high=0.5", r"loss.is_high=0.5 must be >= 1"),
    ("training.micro_batch_size=0", r"training.micro_batch_size=0 must be >= 1"),
    ("training.ppo_epochs=0", r"training.ppo_epochs=0 must be >= 1"),
    # rewards, timeouts, fractions, counts
    ("domains.math.reward.timeout_s=0", r"domains.math.reward.timeout_s=0.0 must be in \(0, 86400\]"),
    ("domains.math.reward.timeout_s=.inf", r"domains.math.reward.timeout_s=inf must be a finite number"),
    ("domains.math.reward.name=''", r"domains.math.reward.name='' must name a reward"),
    ("rewards.max_error_frac=1.5", r"rewards.max_error_frac=1.5 must be in \[0, 1\] \(1 never stops the run\)"),
    ("distributed.timeout_minutes=0", r"distributed.timeout_minutes=0.0 must be > 0"),
    ("checkpoint.time_limit_margin_s=-1", r"checkpoint.time_limit_margin_s=-1.0 must be >= 0"),
    ("checkpoint.every_steps=-1", r"checkpoint.every_steps=-1 must be >= 0"),
    ("checkpoint.keep_last=-1", r"checkpoint.keep_last=-1 must be >= 0"),
    ("data.max_prompt_tokens=0", r"data.max_prompt_tokens=0 must be >= 1"),
    ("cluster.gpus_per_node=0", r"cluster.gpus_per_node=0 must be >= 1"),
    ("cluster.gpu_memory_gib=-80", r"cluster.gpu_memory_gib=-80.0 must be > 0"),
    ("seed=-1", r"seed=-1 must be in \[0, 4294967296\)"),
    ("seed=1099511627776", r"seed=1099511627776 must be in \[0, 4294967296\)"),
    ("tokenizer=''", r"tokenizer='' must name a tokenizer"),
    # model and layout
    ("model.num_layers=0", r"model.num_layers=0 must be >= 1"),
    ("model.norm_epsilon=0", r"model.norm_epsilon=0.0 must be > 0"),
    ("model.attention_dropout=1.0", r"model.attention_dropout=1.0 must be in \[0, 1\)"),
    ("model.rotary_percent=1.5", r"model.rotary_percent=1.5 must be in \(0, 1\]"),
    ("model.hidden_size=66", r"model.num_attention_heads=4 does not divide model.hidden_size=66"),
    ("model.moe.num_experts=0", r"model.moe.num_experts=0 must be >= 1"),
    ("model.fp8.amax_history_len=0", r"model.fp8.amax_history_len=0 must be >= 1"),
    ("parallel.tensor_model_parallel_size=0", r"parallel.tensor_model_parallel_size=0 must be >= 1"),
    # stages (the run-level value was fine: the stage's own value or override is named)
    ("stages.if_rl.steps=0", r"stages\[1\].steps=0 must be >= 1"),
    ("stages.if_rl.samples_per_prompt=1", r"stages\[1\].samples_per_prompt=1: a grpo stage needs >= 2"),
    ("stages.if_rl.domains.instruction_following=0", r"stages\[1\].domains.instruction_following=0.0 must be > 0"),
    ("stages.if_rl.rollout.top_p=2", r"stages\[1\] \(if_rl\): rollout.top_p=2.0 must be in \(0, 1\]"),
    ("stages.if_rl.loss.kl_coef=-1", r"stages\[1\] \(if_rl\): loss.kl_coef=-1.0 must be >= 0"),
    ("stages.if_rl.training.ppo_epochs=0", r"stages\[1\] \(if_rl\): training.ppo_epochs=0 must be >= 1"),
    ("stages.sft.optimizer.lr_warmup_init=1", r"stages\[0\] \(sft\): optimizer.lr_warmup_init=1.0 must be in \[0"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[o if isinstance(o, str) else " ".join(o) for o, _ in BAD])
def test_bad_value_is_refused_at_load_naming_file_key_and_reason(overrides, message):
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    # The value's origin leads (issue 28: a command-line value was blamed on the YAML file).
    origin = "|".join(re.escape(f"command-line override {item!r}: ") for item in overrides)
    with pytest.raises(ConfigError, match=f"^({origin}|{re.escape(CI)}: ).*" + message):
        load_config(CI, overrides, check_paths=False)


def test_bad_value_in_the_yaml_file_is_refused_naming_that_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(f"defaults: [{CI}]\nrollout: {{temperature: 0.7, top_p: 1.5}}\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml:2: rollout.top_p=1.5 must be in \(0, 1\]"):
        load_config(str(path), check_paths=False)


def test_the_boundaries_themselves_are_accepted():
    cfg = load_config(CI, ["rollout.top_p=1.0", "rollout.top_k=0", "eval.temperature=0", "optimizer.clip_grad=0",
                           "loss.kl_coef=0", "rewards.max_error_frac=1", "checkpoint.keep_last=0", "seed=0",
                           "loss.is_low=1", "loss.is_high=1", "eval.samples=3", "eval.temperature=0.6"],
                      check_paths=False)
    assert (cfg.rollout.top_p, cfg.eval.samples, cfg.checkpoint.keep_last) == (1.0, 3, 0)


def _sections(cls, seen=None):
    """Every config dataclass reachable from ``cls``."""
    seen = set() if seen is None else seen
    if cls in seen:
        return seen
    seen.add(cls)
    for hint in typing.get_type_hints(cls).values():
        for arg in (hint, *typing.get_args(hint), *[a for h in typing.get_args(hint) for a in typing.get_args(h)]):
            if dataclasses.is_dataclass(arg):
                _sections(arg, seen)
    return seen


def _is_number(hint) -> bool:
    """int, float or Optional of them (a dict of weights is checked by its section's ``validate``)."""
    return hint in (int, float) or (typing.get_origin(hint) is typing.Union
                                    and any(a in (int, float) for a in typing.get_args(hint)))


def test_every_numeric_field_of_the_schema_declares_its_valid_range():
    """A new int/float config field must say which values it accepts (``ranged``), next to the field."""
    missing = [f"{cls.__name__}.{f.name}" for cls in _sections(RunConfig) for f in dataclasses.fields(cls)
               if _is_number(typing.get_type_hints(cls)[f.name]) and _RULE not in f.metadata]
    assert not missing, f"numeric config fields without a range rule: {missing}"
