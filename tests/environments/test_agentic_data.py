"""The agentic example's data (examples/tiny_cascade/make_agentic_data.py): committed files are what the
generator writes, splits are disjoint, and an SFT trace is token for token the episode the
``tool_calling`` environment builds (so SFT teaches exactly the turns RL samples), scoring 1."""

import importlib.util
import json
from pathlib import Path

from megatron_cascade.environments import build_environment
from megatron_cascade.rewards import get_reward
from megatron_cascade.rewards.registry import EPISODE_RECORD
from megatron_cascade.tokenizers import CharTokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade"
TOK = CharTokenizer()


def _generator():
    spec = importlib.util.spec_from_file_location("make_agentic_data", EXAMPLE / "make_agentic_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_committed_data_is_what_the_generator_writes(tmp_path):
    _generator().main(["--out", str(tmp_path), "--seed", "0"])
    for name in ("tool_sft.jsonl", "tool_train.jsonl", "tool_eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / "data" / name).read_bytes(), \
            f"{name} is stale: rerun python examples/tiny_cascade/make_agentic_data.py"


def test_splits_are_disjoint():
    train = {r["prompt"] for r in _rows(EXAMPLE / "data" / "tool_train.jsonl")}
    held_out = {r["prompt"] for r in _rows(EXAMPLE / "data" / "tool_eval.jsonl")}
    sft = {r.get("prompt") or r["messages"][0]["content"] for r in _rows(EXAMPLE / "data" / "tool_sft.jsonl")}
    assert not (train & held_out) and not (train & sft) and not (held_out & sft)


def test_sft_trace_is_the_environments_episode():
    gen = _generator()
    row = gen.rl_row(37, 41)
    first, second = gen.sft_rows(37, 41)
    env = build_environment("tool_calling", {}, TOK)
    prompt = TOK.apply_chat_template([{"role": "user", "content": row["prompt"]}])
    call = TOK.encode(first["response"]) + [TOK.eos_id]  # the SFT target of turn 1 (sft_batch adds <eos>)
    step = env.step(env.start(row), call, first["response"])
    # Turn 2's SFT prompt is the episode so far: prompt, the call, the tool's answer turn.
    assert TOK.apply_chat_template(second["messages"]) == prompt + call + step.observation_ids
    answer = TOK.decode(TOK.encode(second["response"]) + [TOK.eos_id])
    record = {"model_turns": [TOK.decode(call), answer], "last_turn_answer": answer}
    assert get_reward("tool_calling")("", {**row, EPISODE_RECORD: record}) == 1.0
    assert env.step(env.start(row), TOK.encode(second["response"]), second["response"]).done
