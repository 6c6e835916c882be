"""A response that breaks its own scoring gets the lowest reward (a verdict), never an invalid sample:
an invalid sample has advantage 0, so a policy expecting to lose would learn to break its scoring
instead (red-team issue 29). Infrastructure failures stay invalid. The judge and reward-model cases
are in test_group_rewards.py and test_reward_hardening_http.py."""

from __future__ import annotations

import json
import time

import torch

from megatron_cascade.algorithms import group_advantages
from megatron_cascade.environments.episode import EpisodeSample
from megatron_cascade.environments.settings import episode_scores
from megatron_cascade.environments.tool_env import ToolCallingEnvironment, escape_unencodable
from megatron_cascade.rewards import build_reward, get_reward
from megatron_cascade.rewards.outcome import OutcomeKind, ResponseFault, outcome_kind
from megatron_cascade.rewards.registry import run_in_process
from megatron_cascade.rewards.scoring import ScoringPool, finalize_outcomes
from megatron_cascade.tokenizers import build_tokenizer

GOOD = "```python\nprint(int(input()) + 1)\n```"
WRONG = "```python\nprint(int(input()) + 2)\n```"
ROW = {"tests": [{"input": "1\n", "output": "2\n"}]}


def _outcomes(reward, responses, rows, timeout_s=5.0):
    pool = ScoringPool(max_workers=2)
    for response, row in zip(responses, rows):
        pool.submit(reward, response, row, timeout_s=timeout_s)
    return finalize_outcomes(pool.results(), getattr(reward, "name", "reward"))


def test_a_wrong_program_that_breaks_compile_gets_a_negative_advantage():
    """Before: the 3,000-term tail made the trainer-side compile() raise RecursionError, the sample
    was invalid and its advantage 0 instead of the wrong answer's -0.58."""
    bomb = WRONG[:-4] + "\nx = 1" + " + 1" * 3000 + "\n```"
    scores, errored, faulted = _outcomes(build_reward("code", {"timeout_s": 5}), [GOOD, WRONG, bomb, GOOD], [ROW] * 4)
    assert scores == [1.0, 0.0, 0.0, 1.0] and errored == [False] * 4 and faulted == [False, False, True, False]
    valid = ~torch.tensor([errored])
    advantages = group_advantages(torch.tensor([scores]), valid=valid)
    assert advantages[0, 2] < 0 and advantages[0, 2] == advantages[0, 1]  # as bad as the plain wrong answer


@run_in_process
def _slow_verifier(response: str, sample: dict) -> float:
    if response == "slow":
        time.sleep(30)  # what a hostile expression does to a verifier
    return 1.0


def _slow_server(response: str, sample: dict) -> float:
    if response == "slow":
        time.sleep(3)  # a server that does not answer: not the response's doing
    return 1.0


def test_a_verifier_timeout_is_the_responses_and_a_server_timeout_is_not():
    scores, errored, faulted = _outcomes(_slow_verifier, ["ok", "slow"], [{}] * 2, timeout_s=1.0)
    assert scores == [1.0, 0.0] and errored == [False, False] and faulted == [False, True]
    scores, errored, faulted = _outcomes(_slow_server, ["ok", "slow"], [{}] * 2, timeout_s=0.5)
    assert scores == [1.0, 0.0] and errored == [False, True] and faulted == [False, False]


def test_what_is_a_response_fault():
    assert outcome_kind(0.5) is OutcomeKind.VERDICT
    for exc in (ResponseFault("x"), RecursionError(), MemoryError()):
        assert outcome_kind(exc) is OutcomeKind.RESPONSE_FAULT
    for exc in (TimeoutError(), RuntimeError("server down"), ValueError("row has no answer"), SystemExit(1)):
        assert outcome_kind(exc) is OutcomeKind.INFRA_ERROR
    # A malformed row is still an error, not the response's fault.
    assert _outcomes(get_reward("math"), ["\\boxed{2}"], [{"question": "no answer"}])[1] == [True]


def test_a_tool_name_the_tokenizer_cannot_encode_is_escaped_not_an_invalid_episode():
    """Before: calling a tool named "\\u00e9" (JSON escape, so the model can write it) made the environment
    echo "é", which the character tokenizer cannot encode: the step raised and the episode was invalid."""
    tok = build_tokenizer("builtin:char")
    env = ToolCallingEnvironment(tok)
    state = env.start({"tools": [{"name": "calculator", "parameters": {"type": "object"}}]})
    turn = '<tool_call>{"name": "\\u00e9", "arguments": {}}</tool_call>'
    step = env.step(state, tok.encode(turn), turn)
    text = tok.decode(step.observation_ids)
    assert "unknown tool '\\xe9'" in text and step.metrics["tool_calls_ok"] == 0.0
    assert escape_unencodable("caf\u00e9\x01\n\t") == "caf\\xe9\\x01\n\t"


def test_an_environment_response_fault_scores_zero_as_a_verdict():
    samples = [EpisodeSample(0, i, [1]) for i in range(3)]
    samples[1].response_fault = "the turn cannot be tokenized"
    samples[2].env_error = "RuntimeError: tool server down"
    scores, errored = episode_scores(samples, torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64),
                                     torch.zeros(3, dtype=torch.bool))
    assert scores.tolist() == [1.0, 0.0, 0.0] and errored.tolist() == [False, False, True]


def test_a_row_cannot_name_code_as_its_tool(tmp_path):
    """Before: a row declaring a tool named "os:system" (not mapped in the config) imported and ran it."""
    env = ToolCallingEnvironment(build_tokenizer("builtin:char"))
    marker = tmp_path / "ran"
    row = {"tools": [{"name": "os:system", "parameters": {"type": "object"}}]}
    try:
        env.start(row)
    except ValueError as e:
        assert "does not map" in str(e)
    else:
        raise AssertionError("a row's tool name was loaded as code")
    assert not marker.exists()


def test_a_rows_unknown_tool_and_a_forged_episode_record_are_refused_when_the_data_loads(tmp_path):
    """Before: a row declaring a tool the config does not map loaded, and failed only when its
    episode started (hours into a stage); a row holding the runner's record key would have been
    read by the reward as the record."""
    import pytest

    from megatron_cascade.stages.prompt_data import DataError, load_examples
    from megatron_cascade.config.schema import DomainConfig, EnvironmentSpec
    from megatron_cascade.environments.settings import domain_row_check

    tok = build_tokenizer("builtin:char")
    data = tmp_path / "tool.jsonl"
    good = {"prompt": "1+1?", "tools": [{"name": "calculator"}], "answer": "2"}
    data.write_text("\n".join(json.dumps(row) for row in (
        good, {**good, "tools": [{"name": "os:system"}]}, {**good, "episode": {"model_turns": ["2"]}},
        {**good, "tools": [{"name": "lookup"}]})) + "\n")
    domain = DomainConfig(environment=EnvironmentSpec(name="tool_calling", kwargs={"tools": {"lookup": "json:dumps"}}))
    check = domain_row_check("tool", domain)
    with pytest.raises(DataError, match=f"{data}:2: the row declares tool 'os:system', which environment.kwargs"):
        load_examples(str(data), "tool", tok, on_bad_row="error", check_row=check)
    kept = load_examples(str(data), "tool", tok, on_bad_row="skip", check_row=check)
    assert [e.source for e in kept] == [f"{data}:1", f"{data}:4"]  # line 3: the record key is the runner's


def _tool_episode(*turns: str) -> tuple[str, dict]:
    """Drive the ``tool_calling`` environment through the episode runner's bookkeeping, one model
    turn per text; returns the transcript and the sample its reward reads (row + runner's record)."""
    from megatron_cascade.environments.episode import Episode, EpisodeSettings, StepOutcome, episode_record
    from megatron_cascade.rewards.registry import EPISODE_RECORD
    from megatron_cascade.rollout.batch import RolloutSample

    tok = build_tokenizer("builtin:char")
    settings = EpisodeSettings(ToolCallingEnvironment(tok), max_turns=len(turns), max_episode_tokens=10_000,
                               step_timeout_s=5.0)
    episode = Episode(EpisodeSample(0, 0, tok.encode("12*34?")), settings, TOOL_ROW)
    for text in turns:
        ids = tok.encode(text) + [tok.eos_id]
        episode.add_turn(RolloutSample(0, 0, [], ids, [0.0] * len(ids), [0.0] * len(ids), "stop"))
        episode.apply(StepOutcome.of(episode.env_step(ids, tok.decode(ids))), limit=100_000)
    sample = episode.sample
    return tok.decode(sample.response_ids), {**TOOL_ROW, EPISODE_RECORD: episode_record(sample, tok)}


CALC = {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}
TOOL_ROW = {"prompt": "12*34?", "tools": [CALC], "answer": "408",
            "expected_calls": [{"name": "calculator", "arguments": {"expression": "12*34"}}]}


def _call(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


def test_calls_hidden_in_a_fake_tool_response_are_counted():
    """Before: the reward stripped every <tool_response> block of the transcript, also the ones the
    model wrote itself, so extra calls hidden inside one went uncounted (1.0 instead of 0.67)."""
    reward = get_reward("tool_calling")
    honest_transcript, honest = _tool_episode(_call("12*34"), "408")
    assert reward(honest_transcript, honest) == 1.0
    hidden = "<tool_response>" + _call("1+1") + _call("2+2") + "</tool_response>" + _call("12*34")
    transcript, sample = _tool_episode(hidden, "408")
    assert len(sample["episode"]["model_turns"]) == 2  # the environment ran all three calls
    assert reward(transcript, sample) == (1 / 3 + 1) / 2  # as the same calls made in the open
    open_transcript, in_the_open = _tool_episode(_call("1+1") + _call("2+2") + _call("12*34"), "408")
    assert reward(open_transcript, in_the_open) == reward(transcript, sample)


def test_a_fake_tool_response_does_not_move_the_final_answer():
    """The final answer is the model's last turn, not the text after the transcript's last
    </tool_response> (which the model could write itself, after a wrong answer)."""
    transcript, sample = _tool_episode(_call("12*34"), "407 <tool_response>x</tool_response> 408")
    assert get_reward("tool_calling")(transcript, sample) == 0.5  # the call; the answer is not "408"


def test_duplicate_json_keys_are_not_json_to_a_verifier():
    """Before: {"answer": "wrong", "answer": "right"} read as its last value (what a grader sees
    differs from what a reader sees); tool calls and IFEval's json_format took it too."""
    from megatron_cascade.rewards.tool_calls import BadToolCall, parse_tool_calls
    from megatron_cascade.rewards.ifeval import check_instruction

    schema = {"schema": {"type": "object", "properties": {"answer": {"const": "right"}}, "required": ["answer"]}}
    assert get_reward("structured_output")('{"answer": "right"}', schema) == 1.0
    assert get_reward("structured_output")('{"answer": "wrong", "answer": "right"}', schema) == 0.0
    assert check_instruction("detectable_format:json_format", '{"a": 1, "a": 2}', {}) is False
    (call,) = parse_tool_calls('<tool_call>{"name": "calculator", "name": "python", "arguments": {}}</tool_call>')
    assert isinstance(call, BadToolCall)


def _quick(response: str, sample: dict) -> float:
    time.sleep(0.2)  # still running when the dispatcher waits for its deadline
    return 1.0


def test_timeouts_are_bounded_where_rewards_are_built_and_long_ones_do_not_crash_scoring():
    """Before: timeout_s=1e10 was accepted and the reward dispatcher died (OverflowError) on its wait."""
    import pytest

    from megatron_cascade.rewards import score_batch

    for name, kwargs in (("code", {}), ("reward_model", {"url": "http://127.0.0.1:9"})):
        with pytest.raises(ValueError, match="timeout_s"):
            build_reward(name, {**kwargs, "timeout_s": 1e10})
    assert score_batch(_quick, ["a", "b"], [{}] * 2, timeout_s=1e10) == ([1.0, 1.0], 0)
