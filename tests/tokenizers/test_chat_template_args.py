"""Chat-template arguments from the config (``chat_template_kwargs``) and per-row ``tools``, rendered by a
tiny Hugging Face tokenizer built and saved by the test itself (offline), through the project's paths:
the config, the data loader, the tool-turn renderer and the resume check."""

from __future__ import annotations

import json
import os

import pytest

from megatron_cascade.stages.prompt_data import DataError, load_examples
from megatron_cascade.cascade.manifest import Manifest
from megatron_cascade.cascade.resume_check import check_resume
from megatron_cascade.config import ConfigError, load_config, to_yaml
from megatron_cascade.environments.chat import tool_turn_ids
from megatron_cascade.tokenizers import CharTokenizer, build_tokenizer

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny_cascade", "cascade.yaml")

# Like Qwen3's and Nemotron-3-Nano's templates: tool names in a system turn when the conversation has
# tools, and an empty reasoning block after the assistant prefix when enable_thinking is false.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools :{% for t in tools %} {{ t['name'] }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
            "<think>", "</think>"]
WORDS = ["what", "is", "two", "plus", "?", "tools", ":", "calculator", "search", "q", "a", "x"]
TOOLS = [{"name": "calculator", "description": "Evaluate an arithmetic expression.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]
MESSAGES = [{"role": "user", "content": "what is two plus two ?"}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A word-level fast tokenizer with :data:`CHAT_TEMPLATE`, saved to a local folder."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=SPECIALS[4:])
    fast.chat_template = CHAT_TEMPLATE
    path = str(tmp_path_factory.mktemp("hf_template_tok"))
    fast.save_pretrained(path)
    return path


def _template_ids(tok, messages, **template_args) -> list[int]:
    """What ``transformers`` itself renders for ``messages`` with ``template_args``, as token ids."""
    text = tok.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                **template_args)
    return tok.encode(text)


def _write_rows(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _config(tmp_path, hf_dir: str, *overrides: str):
    """The tiny cascade's config with the test's Hugging Face tokenizer."""
    return load_config(TINY, [f"output_dir={tmp_path / 'run'}", f"tokenizer={hf_dir}", *overrides])


# -- (a) chat_template_kwargs from the config reach every rendering ---------------------------------------

def test_config_kwargs_change_the_prompt_as_the_template_renders_them(tmp_path, hf_dir):
    cfg = _config(tmp_path, hf_dir, "chat_template_kwargs.enable_thinking=false")
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    thinking_off = build_tokenizer(cfg.tokenizer, cfg.chat_template_kwargs)
    default = build_tokenizer(_config(tmp_path, hf_dir).tokenizer)
    data = _write_rows(tmp_path / "rows.jsonl", [{"prompt": MESSAGES[0]["content"]}])

    off_ids = list(load_examples(data, "math", thinking_off)[0].prompt_ids)
    default_ids = list(load_examples(data, "math", default)[0].prompt_ids)
    assert off_ids != default_ids
    assert off_ids == _template_ids(thinking_off, MESSAGES, enable_thinking=False)
    assert default_ids == _template_ids(default, MESSAGES)
    assert off_ids[-2:] == thinking_off.encode("<think></think>")


def test_config_kwargs_reach_the_tool_turns_of_episodes(hf_dir):
    thinking_off = build_tokenizer(hf_dir, {"enable_thinking": False})
    observation = tool_turn_ids(thinking_off, ["x"], turn_ended=True)
    assert observation == thinking_off.encode("<|tool|>x</s><|assistant|><think></think>")
    assert tool_turn_ids(build_tokenizer(hf_dir), ["x"], turn_ended=True)[-1] == thinking_off.encode("<|assistant|>")[0]


def test_kwargs_leave_the_vocabulary_fingerprint_alone(hf_dir):
    assert build_tokenizer(hf_dir, {"enable_thinking": False}).fingerprint() == build_tokenizer(hf_dir).fingerprint()


def test_the_run_builds_its_tokenizer_with_the_config_kwargs(tmp_path, hf_dir):
    from megatron_cascade.cascade.runner import build_context

    cfg = _config(tmp_path, hf_dir, "chat_template_kwargs.enable_thinking=false")
    assert build_context(cfg).tokenizer.chat_template_kwargs == {"enable_thinking": False}


# -- (b) a row's tools are rendered by the template ----------------------------------------------------------

def test_row_tools_are_rendered_by_the_hf_template(tmp_path, hf_dir):
    tok = build_tokenizer(hf_dir)
    data = _write_rows(tmp_path / "tool.jsonl", [{"prompt": MESSAGES[0]["content"], "tools": TOOLS}])
    ids = list(load_examples(data, "tool", tok)[0].prompt_ids)
    assert ids == _template_ids(tok, MESSAGES, tools=TOOLS)
    assert tok.encode("calculator")[0] in ids
    assert ids != _template_ids(tok, MESSAGES)


def test_char_prompts_of_tool_rows_are_unchanged(tmp_path):
    char = CharTokenizer()
    data = _write_rows(tmp_path / "tool.jsonl", [{"prompt": "What is 2*3? Use the calculator.", "tools": TOOLS}])
    ids = list(load_examples(data, "tool", char)[0].prompt_ids)
    assert ids == char.apply_chat_template([{"role": "user", "content": "What is 2*3? Use the calculator."}])


# -- (c) the char tokenizer has no Jinja template --------------------------------------------------------------

def test_char_tokenizer_refuses_chat_template_kwargs(tmp_path):
    with pytest.raises(ConfigError, match=r"chat_template_kwargs=\{'enable_thinking': False\} needs a Hugging Face "
                                          r"tokenizer with a Jinja chat template; tokenizer='builtin:char' has none"):
        load_config(TINY, [f"output_dir={tmp_path}", "chat_template_kwargs.enable_thinking=false"])
    with pytest.raises(ValueError, match="no Jinja chat template"):
        build_tokenizer("builtin:char", {"enable_thinking": False})


@pytest.mark.parametrize("override, message", [
    ("chat_template_kwargs={tools: []}", r"\['tools'\] are arguments of apply_chat_template itself"),
    ("chat_template_kwargs={'not a name': 1}", "must map variable names"),
])
def test_kwargs_must_be_template_variables(tmp_path, hf_dir, override, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, hf_dir, override)


# -- (d) a started run resumes only with the kwargs it was started with -----------------------------------

def test_resume_refuses_changed_chat_template_kwargs(tmp_path, hf_dir):
    cfg = _config(tmp_path, hf_dir)
    os.makedirs(cfg.output_dir)
    with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    first = cfg.stages[0].name
    Manifest(cfg.output_dir).record_stage(first, {"status": "complete", "final_weights": f"stages/{first}/final"})

    changed = _config(tmp_path, hf_dir, "chat_template_kwargs.enable_thinking=false")
    with pytest.raises(ConfigError, match=r"chat_template_kwargs.enable_thinking: None -> False"):
        check_resume(changed)
    accepted = check_resume(changed, allowed=["chat_template_kwargs"])
    assert "chat_template_kwargs.enable_thinking" in [c.key for c in accepted]
    assert check_resume(cfg) == []


# -- (e) malformed tools are bad rows named by file:line -------------------------------------------------------

@pytest.mark.parametrize("tools", ["calculator", [{"name": "calculator"}, "search"], {"name": "calculator"}])
def test_malformed_tools_are_a_data_error_naming_file_and_line(tmp_path, hf_dir, tools):
    data = _write_rows(tmp_path / "tool.jsonl", [{"prompt": "q", "tools": TOOLS}, {"prompt": "q", "tools": tools}])
    with pytest.raises(DataError, match=rf"^{data}:2: 'tools' must be a list of JSON objects"):
        load_examples(data, "tool", build_tokenizer(hf_dir), on_bad_row="error")
    assert len(load_examples(data, "tool", build_tokenizer(hf_dir))) == 1  # skipped by default
