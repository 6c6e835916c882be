"""Tool calling without a model: parsing ``<tool_call>`` blocks, the calculator, the ``tool_calling``
environment's steps (declared tools, schema-checked arguments, errors fed back, a tool-response turn
in the tokenizer's chat format), the ``tool_calling`` reward, and the environment config/registry."""

import json

import pytest

from megatron_cascade.config.model import ConfigError
from megatron_cascade.config.rules import validate_tree
from megatron_cascade.config.schema import DomainConfig, EnvironmentSpec
from megatron_cascade.environments import build_environment
from megatron_cascade.environments.chat import tool_turn_ids
from megatron_cascade.environments.settings import domain_episode_settings
from megatron_cascade.rewards.tool_calls import BadToolCall, ToolCall, parse_tool_calls
from megatron_cascade.environments.tools import calculator
from megatron_cascade.rewards import get_reward
from megatron_cascade.rewards.registry import EPISODE_RECORD
from megatron_cascade.tokenizers import CharTokenizer

TOK = CharTokenizer()
CALC = {"name": "calculator", "description": "arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"], "additionalProperties": False}}
ROW = {"prompt": "12*34?", "tools": [CALC], "answer": "408",
       "expected_calls": [{"name": "calculator", "arguments": {"expression": "12*34"}}]}


def call(name="calculator", **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_parse_tool_calls():
    text = ("think " + call(expression="1+1") + " and <tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}"
            "</tool_call><tool_call>not json</tool_call><tool_call>[1]</tool_call><tool_call>{\"name\": \"g\"")
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "1+1"})
    assert calls[1] == ToolCall("f", {"a": 1})  # OpenAI-style arguments string
    assert [type(c) for c in calls[2:]] == [BadToolCall] * 3
    assert "never closed" in calls[4].reason
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize("expr,value", [("12*34", "408"), ("(1+2)*3-4/2", "7"), ("7/2", "3.5"), ("-2**3", "-8")])
def test_calculator(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "9**9**9", "1/0", "x+1", "10**20"])
def test_calculator_refuses(expr):
    with pytest.raises(ValueError):
        calculator(expr)


def test_tool_env_runs_declared_calls_and_answers_in_the_chat_format():
    env = build_environment("tool_calling", {}, TOK)
    state = env.start(ROW)
    action = call(expression="12*34")
    step = env.step(state, TOK.encode(action) + [TOK.eos_id], action)
    assert not step.done and step.metrics == {"tool_calls": 1.0, "tool_calls_ok": 1.0}
    # The turn after the model's <eos>: a user turn with the result, then the assistant prefix.
    assert step.observation_ids == TOK.apply_chat_template(
        [{"role": "user", "content": "<tool_response>\n408\n</tool_response>"}])[1:]
    # A turn ended by a stop string instead of <eos>: the observation closes it first.
    assert env.step(state, TOK.encode(action), action).observation_ids[0] == TOK.eos_id
    # A turn without a call is the final answer.
    assert env.step(state, TOK.encode("408"), "408").done


def test_tool_env_feeds_errors_back():
    env = build_environment("tool_calling", {}, TOK)
    state = env.start(ROW)
    action = call(expression="1/0") + call("search", q="x") + call(expr="1") + "<tool_call>{"
    step = env.step(state, TOK.encode(action), action)
    text = TOK.decode(step.observation_ids)
    assert step.metrics == {"tool_calls": 4.0, "tool_calls_ok": 0.0}
    assert "division by zero" in text and "unknown tool 'search'" in text
    assert "invalid arguments for calculator" in text and "never closed" in text


def test_user_tool_by_import_path():
    env = build_environment("tool_calling", {"tools": {"lookup": "json:dumps"}}, TOK)
    row = {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]}
    action = call("lookup", obj=[1, 2])
    step = env.step(env.start(row), TOK.encode(action), action)
    assert "[1, 2]" in TOK.decode(step.observation_ids) and step.metrics["tool_calls_ok"] == 1.0


def scored(reward, *turns: str, row=ROW) -> float:
    """The reward of an episode whose model turns were ``turns`` (the runner's record of it)."""
    return reward("".join(turns), {**row, EPISODE_RECORD: {"model_turns": list(turns), "last_turn_answer": turns[-1]}})


def test_tool_calling_reward_compares_calls_and_answer():
    reward = get_reward("tool_calling")
    assert scored(reward, call(expression="12*34"), "408") == 1.0
    assert scored(reward, "408") == 0.5  # right answer, no call
    # The right tool with other arguments earns half the call.
    assert scored(reward, call(expression="12 * 34"), "408") == 0.75
    assert scored(reward, call(expression="12*34"), "407") == 0.5  # right call, wrong answer
    assert scored(reward, call(expression="12*34"), call(expression="12*34"), "408") == 0.75  # 1 of 2 calls
    # JSON validity alone is not enough (the old structured check would give this full credit).
    assert scored(reward, call("calculator", expression="1+1"), "2") == 0.25
    assert scored(reward, call("search", q="12*34"), "x") == 0.0
    with pytest.raises(ValueError):
        reward("x", {"prompt": "no ground truth", EPISODE_RECORD: {"model_turns": ["x"], "last_turn_answer": "x"}})
    with pytest.raises(ValueError, match="runner's record"):  # the transcript alone is never scored
        reward(call(expression="12*34") + "408", ROW)


def test_environment_config_is_checked_and_named():
    with pytest.raises(ConfigError, match="max_turns"):
        validate_tree(DomainConfig(environment=EnvironmentSpec(max_turns=0)), "domains.d.")
    with pytest.raises(ConfigError, match="step_timeout_s"):
        validate_tree(DomainConfig(environment=EnvironmentSpec(step_timeout_s=0)), "domains.d.")
    bad = {"d": DomainConfig(environment=EnvironmentSpec(name="tool_calling", kwargs={"tool": {}}))}
    with pytest.raises(ConfigError, match=r"domains\.d\.environment: .*unknown kwarg\(s\) \['tool'\]"):
        domain_episode_settings(bad, ["d"], TOK, 8)
    with pytest.raises(ConfigError, match="domains.d.environment: unknown environment 'nope'"):
        domain_episode_settings({"d": DomainConfig(environment=EnvironmentSpec(name="nope"))}, ["d"], TOK, 8)
    settings = domain_episode_settings({"d": DomainConfig(), "t": DomainConfig(
        environment=EnvironmentSpec(name="tool_calling", max_turns=3))}, ["d", "t"], TOK, 8)
    assert (settings["d"].max_turns, settings["d"].max_episode_tokens) == (1, 8)  # single_turn: one turn
    assert (settings["t"].max_turns, settings["t"].max_episode_tokens) == (3, 24)


def _hf_tokenizer(tmp_path, template):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_cascade.tokenizers import build_tokenizer

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<tool_response>", "</tool_response>"]
    vocab = {t: i for i, t in enumerate(specials + ["user", "assistant", "q", "a", "408", "7"])}
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=specials[2:4])
    fast.chat_template = template
    fast.save_pretrained(str(tmp_path))
    return build_tokenizer(str(tmp_path))


# Qwen3's shape: tool messages become one user turn of <tool_response> blocks.
QWEN_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|> user{% endif %}"
    " <tool_response> {{ m['content'] }} </tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{% endif %}"
    "{% else %}<|im_start|> {{ m['role'] }} {{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant{% endif %}")


def test_tool_turn_in_a_hugging_face_template(tmp_path):
    tok = _hf_tokenizer(tmp_path, QWEN_LIKE)
    obs = tool_turn_ids(tok, ["408", "7"], turn_ended=True)
    assert obs == tok.encode("<|im_start|> user <tool_response> 408 </tool_response> <tool_response> 7 "
                             "</tool_response><|im_end|><|im_start|> assistant")


def test_python_tool_runs_in_the_code_sandbox():
    """The ``python`` tool: the program runs in the code sandbox (its own uid, no host files) and a
    runaway one is killed at python_timeout_s, its result an error the model sees."""
    env = build_environment("tool_calling", {"tools": {"py": "python"}, "python_timeout_s": 2.0}, TOK)
    row = {"tools": [{"name": "py", "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                   "required": ["code"]}}]}
    state = env.start(row)
    action = call("py", code="import os; print(6 * 7, os.getuid() != 0, os.path.exists('/work'))")
    assert "42 True False" in TOK.decode(env.step(state, TOK.encode(action), action).observation_ids)
    action = call("py", code="while True: pass")
    step = env.step(state, TOK.encode(action), action)
    assert "error: timed out" in TOK.decode(step.observation_ids) and step.metrics["tool_calls_ok"] == 0.0
