"""User mistakes get one clear error: config keys and types, malformed rows, teachers, vocabularies."""

import json
import logging
import os
import re

import pytest
from cascade_fixtures import run_cli, write_short_config

from megatron_cascade.stages.prompt_data import DataError, load_examples
from megatron_cascade.stages.teachers import TOKENIZER_FINGERPRINT_FILE, VocabularyMismatch, check_teacher_vocabulary
from megatron_cascade.config import ConfigError, ModelConfig, load_config
from megatron_cascade.tokenizers import build_tokenizer

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny_cascade", "cascade.yaml")


@pytest.fixture
def short(tmp_path):
    return write_short_config(str(tmp_path), str(tmp_path / "out"))


@pytest.mark.parametrize("override,message", [
    ("model.hiden_size=64", "config key 'model.hiden_size'.*Did you mean.*hidden_size"),
    ("model.hidden_size=big", "config key 'model.hidden_size'.*could not be converted"),
    ("stages.if_rl.optimzer.lr=1", "Did you mean.*optimizer"),
    ("stages.if_rl.optimizer.lrr=1", "stage 'if_rl': 'optimizer.lrr'.*Did you mean.*'lr'"),
    ("stages.nope.steps=1", "no stage named 'nope'"),
    ("stages.if_rl.type=ppo", r"type='ppo' is not one of"),
    ("stages.if_rl.domains={chess: 1.0}", "domain 'chess' is not defined"),
    ("stages.mopd.domains={code: 1.0}", "mopd needs a teacher for domain .code."),
    ("stages.mopd.teachers.math=rlhf", "neither an earlier stage"),
    ("stages.mopd.teachers.math=./no/such/folder", "checkpoint folder .* does not exist"),
    ("stages.sft.teachers={math: sft}", "only used by stage types that distill from teachers"),
    ("stages.if_rl.optimizer.lr_decay_style=step", r"lr_decay_style='step' is not one of"),
    ("loss.importance_correction=clip", r"importance_correction='clip' is not one of"),
    ("stages.if_rl.rollout.max_new_tokens=1000", "leaves no room for the prompt"),
    ("stages.if_rl.optimizer.initial_loss_scale=1024", r"\(if_rl\): optimizer.initial_loss_scale.*fp16 only"),
])
def test_config_mistakes_name_the_key(short, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(short, [override])


def test_teacher_must_be_an_earlier_stage(tmp_path):
    path = write_short_config(str(tmp_path), str(tmp_path / "o"), extra="")
    with pytest.raises(ConfigError, match=r"teachers.instruction_following='if_rl' is neither an earlier stage"):
        load_config(path, ["stages.if_rl.name=later", "stages.mopd.teachers.instruction_following=if_rl"])


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("output_dir: x\nmodel: {num_layer: 2}\nstages: []\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*model.num_layer"):
        load_config(str(path))


def test_cli_reports_a_config_error_in_one_line(short):
    result = run_cli("run", short, "model.hiden_size=3", timeout=120)
    assert result.returncode == 2
    assert "configuration error" in result.stdout and "Traceback" not in result.stdout


def _write_rows(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


BAD_ROWS = [
    {"prompt": "1+1=", "answer": "2"},
    "{not json",
    {"answer": "3"},
    {"prompt": "2+1=", "domain": "code"},
    ["a", "list"],
    {"prompt": "é is not in the char vocabulary"},
    {"prompt": "3+1=", "answer": "4"},
]


def test_malformed_rows_are_reported_with_file_and_line_and_skipped(tmp_path, caplog):
    path = tmp_path / "math.jsonl"
    _write_rows(path, BAD_ROWS)
    with caplog.at_level(logging.WARNING):
        examples = load_examples(str(path), "math", build_tokenizer("builtin:char"))
    assert [e.row["prompt"] for e in examples] == ["1+1=", "3+1="]
    text = caplog.text
    for line, reason in [(2, "not valid JSON"), (3, "a row needs a non-empty string 'prompt'"),
                         (4, "row says domain 'code'"), (5, "a row must be a JSON object"), (6, "cannot tokenise")]:
        assert f"math.jsonl:{line}: skipping bad row: {reason}" in text
    assert "5 bad row(s) skipped, 2 used" in text


def test_malformed_row_is_fatal_when_configured(tmp_path):
    path = tmp_path / "math.jsonl"
    _write_rows(path, BAD_ROWS)
    with pytest.raises(DataError, match=r"math.jsonl:2: not valid JSON"):
        load_examples(str(path), "math", build_tokenizer("builtin:char"), on_bad_row="error")


def _write_invalid_utf8(path):
    """Row 2 holds a lone continuation byte (0x80), row 4 a truncated 3-byte sequence: not UTF-8."""
    path.write_bytes(b'{"prompt": "1+1="}\n{"prompt": "2+\x80"}\n\n{"prompt": "\xe2\x82"}\n{"prompt": "3+1="}\n')


def test_invalid_utf8_row_is_reported_with_file_and_line_and_skipped(tmp_path, caplog):
    path = tmp_path / "math.jsonl"
    _write_invalid_utf8(path)
    with caplog.at_level(logging.WARNING):
        examples = load_examples(str(path), "math", build_tokenizer("builtin:char"))
    assert [(e.row["prompt"], e.source.rsplit(":", 1)[1]) for e in examples] == [("1+1=", "1"), ("3+1=", "5")]
    assert "math.jsonl:2: skipping bad row: not valid UTF-8: byte 0x80 at column 15" in caplog.text
    assert "math.jsonl:4: skipping bad row: not valid UTF-8: byte 0xe2 at column 13" in caplog.text
    assert "2 bad row(s) skipped, 2 used" in caplog.text


def test_invalid_utf8_row_is_fatal_when_configured(tmp_path):
    path = tmp_path / "math.jsonl"
    _write_invalid_utf8(path)
    with pytest.raises(DataError, match=r"math.jsonl:2: not valid UTF-8"):
        load_examples(str(path), "math", build_tokenizer("builtin:char"), on_bad_row="error")


def test_sft_rows_need_a_response(tmp_path):
    path = tmp_path / "m.jsonl"
    _write_rows(path, [{"prompt": "1+1="}])
    with pytest.raises(DataError, match="m.jsonl: no usable rows"):
        load_examples(str(path), "math", build_tokenizer("builtin:char"), need_response=True)


def _fake_teacher(folder, padded_vocab, fingerprint):
    os.makedirs(folder)
    with open(os.path.join(folder, "model_config.json"), "w") as f:
        json.dump({"architecture": {"padded_vocab_size": padded_vocab}}, f)
    with open(os.path.join(folder, TOKENIZER_FINGERPRINT_FILE), "w") as f:
        f.write(fingerprint)
    return str(folder)


def test_teacher_with_another_vocabulary_is_refused(tmp_path):
    student = ModelConfig(vocab_size=103)
    tok = build_tokenizer("builtin:char").fingerprint()
    check_teacher_vocabulary(_fake_teacher(tmp_path / "same", 128, tok), student, tok, "teachers.math")
    with pytest.raises(VocabularyMismatch, match="padded vocab size 256, the student 128"):
        check_teacher_vocabulary(_fake_teacher(tmp_path / "big", 256, tok), student, tok, "teachers.math")
    with pytest.raises(VocabularyMismatch, match="trained with another tokenizer"):
        check_teacher_vocabulary(_fake_teacher(tmp_path / "other", 128, "f" * 64), student, tok, "teachers.math")


def test_every_unknown_yaml_key_in_one_report_at_its_line(tmp_path):
    """Issue 28: only the first of several YAML typos was reported per run, with no line."""
    base = tmp_path / "base.yaml"
    base.write_text("output_dir: x\nmodel:\n  num_layers: 2\n  hiden_size: 8\nstages: []\n")
    path = tmp_path / "bad.yaml"
    path.write_text("defaults: [base.yaml]\n"
                    "model: {num_layer: 2}\n"
                    "stages:\n"
                    "  - name: a\n"
                    "    type: sft\n"
                    "    stpes: 3\n"
                    "    optimizer: {lrr: 1}\n"
                    "    rollout: {parallel: {tensr_model_parallel_size: 2}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value).splitlines() == [
        "5 unknown config keys:",
        f"  {base}:4: unknown config key 'model.hiden_size' (did you mean 'hidden_size'?)",
        "  bad.yaml:2: unknown config key 'model.num_layer' (did you mean 'num_layers'?)".replace("bad.yaml", str(path)),
        f"  {path}:6: unknown config key 'stages.0.stpes' (did you mean 'steps'?)",
        f"  {path}:7: unknown config key 'stages.0.optimizer.lrr' (did you mean 'lr'?)",
        f"  {path}:8: unknown config key 'stages.0.rollout.parallel.tensr_model_parallel_size' "
        "(did you mean 'tensor_model_parallel_size'?)",
    ]


@pytest.mark.parametrize("overrides,origin", [
    (["stages.if_rl.steps=0"], "command-line override 'stages.if_rl.steps=0': stages[1].steps=0 must be >= 1"),
    (["stages.if_rl.rollout.temperature=-1"], "command-line override 'stages.if_rl.rollout.temperature=-1': "
                                              "stages[1] (if_rl): rollout.temperature=-1.0 must be > 0"),
    (["seed=3", "optimizer.lr=-1"], "command-line override 'optimizer.lr=-1': optimizer.lr=-1.0 must be >= 0"),
])
def test_a_bad_value_names_the_override_that_set_it(overrides, origin):
    """Issue 28: a command-line value was blamed on the YAML file."""
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert str(err.value).startswith(origin), str(err.value)


def test_a_bad_yaml_value_names_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"defaults: [{TINY}]\nseed: 2\nrollout:\n  temperature: -2\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:4: rollout.temperature=-2.0 must be > 0")):
        load_config(str(path))


def test_every_bad_value_in_one_report_each_with_its_origin(tmp_path):
    """Issue 28: one mistake per run -- the next bad value surfaced only after the first was fixed."""
    path = tmp_path / "run.yaml"
    path.write_text(f"defaults: [{TINY}]\nrollout:\n  temperature: -2\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), ["stages.if_rl.steps=0", "stages.math_rl.rollout.top_p=3"])
    assert str(err.value).splitlines() == [
        "3 bad config values:",
        f"  {path}:3: rollout.temperature=-2.0 must be > 0 (the trainer divides the logits by it; greedy is "
        "eval.temperature: 0)",
        "  command-line override 'stages.if_rl.steps=0': stages[1].steps=0 must be >= 1",
        "  command-line override 'stages.math_rl.rollout.top_p=3': stages[2] (math_rl): rollout.top_p=3.0 must be "
        "in (0, 1]",
    ]
