"""Registry lookup, kwarg validation, dotted-path imports and error-proof batch scoring."""

from __future__ import annotations

import logging
import sys
import time
import types

import pytest

from megatron_cascade.rewards import REWARDS, build_reward, get_reward, register_reward, score_batch


def test_builtins_resolve():
    for name in ("math", "code", "instruction_following", "structured_output",
                 "multiple_choice", "reward_model"):
        get_reward(name) if name != "reward_model" else build_reward(name, {"url": "http://x"})
        assert name in REWARDS


def test_register_decorator():
    @register_reward("test_constant")
    def constant(response: str, sample: dict, *, value: float = 0.25) -> float:
        return value

    assert REWARDS["test_constant"] is constant
    assert get_reward("test_constant")("r", {}) == 0.25
    assert build_reward("test_constant", {"value": 0.75})("r", {}) == 0.75


@pytest.fixture
def user_module():
    mod = types.ModuleType("mc_user_rewards")
    mod.length_reward = lambda response, sample: min(1.0, len(response) / 10)
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


@pytest.mark.parametrize("path", ["mc_user_rewards:length_reward", "mc_user_rewards.length_reward"])
def test_dotted_path(user_module, path):
    assert get_reward(path)("abcde", {}) == 0.5


def test_unknown_name():
    with pytest.raises((KeyError, ModuleNotFoundError)):
        get_reward("no_such_reward_anywhere")


def test_unknown_kwarg_is_named():
    with pytest.raises(TypeError, match="timeout_sec") as info:
        build_reward("code", {"timeout_sec": 5})
    assert "timeout_s" in str(info.value)  # lists the valid ones


def _flaky(response: str, sample: dict) -> float:
    if response == "raise":
        raise RuntimeError("boom")
    if response == "hang":
        time.sleep(5)
    if response == "nan":
        return float("nan")
    return 1.5 if response == "big" else 0.5


def test_score_batch_survives_errors_and_timeouts(caplog):
    responses = ["ok", "raise", "hang", "nan", "big", "ok"]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megatron_cascade.rewards.scoring"):
        scores, errors = score_batch(_flaky, responses, [{}] * 6, timeout_s=0.5, max_workers=2)
    assert time.monotonic() - start < 4.0  # the hung call (5 s) was abandoned, not awaited
    assert scores == [0.5, 0.0, 0.0, 0.0, 1.0, 0.5]
    assert errors == 3
    assert "boom" in caplog.text and "timed out" in caplog.text


def test_score_batch_hang_does_not_block_queue():
    """With 1 worker, a hung item is abandoned and the rest still run."""
    scores, errors = score_batch(_flaky, ["hang", "ok", "ok"], [{}] * 3, timeout_s=0.3, max_workers=1)
    assert scores == [0.0, 0.5, 0.5] and errors == 1


def test_score_batch_uses_code_batch(no_leftovers):
    reward = build_reward("code", {"timeout_s": 2})
    tests = [{"input": "", "output": "hi"}]
    good, bad = "```python\nprint('hi')\n```", "```python\nprint('no')\n```"
    scores, errors = score_batch(reward, [good, bad, good], [{"tests": tests}] * 3)
    assert scores == [1.0, 0.0, 1.0] and errors == 0


def test_score_batch_length_mismatch():
    with pytest.raises(ValueError):
        score_batch(_flaky, ["a"], [])
