"""The tiny-cascade data: reproducible from make_data.py, verifiable, held-out eval sets."""

import importlib.util
import json
import math
import random
import re
from pathlib import Path

import pytest

from megatron_cascade.rewards import get_reward, score_batch
from megatron_cascade.rewards.registry import build_reward

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade"
DATA = EXAMPLE / "data"
DOMAINS = ("math", "instruction_following", "code")
SPLITS = ("sft", "train", "eval")
REWARD_FIELD = {"math": "answer", "instruction_following": "instructions", "code": "tests"}
# Each code row is a sandboxed run (~55 ms alone, several times that on a loaded machine): the verifier
# check takes every eval row and this many SFT/RL rows of each program shape, not all 3,000.
CODE_ROWS_PER_SHAPE = 16


def _make_data():
    spec = importlib.util.spec_from_file_location("tiny_cascade_make_data", EXAMPLE / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(domain, split):
    with open(DATA / f"{domain}_{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_committed_data_is_what_make_data_generates(tmp_path):
    _make_data().main(["--out", str(tmp_path), "--seed", "0"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"{d}_{s}.jsonl" for d in DOMAINS for s in SPLITS)
    for name in names:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), \
            f"{name} is stale: rerun python examples/tiny_cascade/make_data.py"
    assert sum(p.stat().st_size for p in DATA.iterdir()) < 3 * 1024 * 1024  # the repo stays small


def test_another_seed_gives_another_split(tmp_path):
    _make_data().main(["--out", str(tmp_path), "--seed", "1"])
    assert (tmp_path / "math_eval.jsonl").read_bytes() != (DATA / "math_eval.jsonl").read_bytes()


@pytest.mark.parametrize("domain", DOMAINS)
def test_rows_are_small_and_well_formed(domain):
    for split in SPLITS:
        rows = _rows(domain, split)
        assert rows
        for row in rows:
            assert row["domain"] == domain and REWARD_FIELD[domain] in row
            assert 0 < len(row["prompt"]) <= 40 and 0 < len(row["response"]) <= 40
            (row["prompt"] + row["response"]).encode("ascii")  # char tokenizer vocabulary
    assert 20 <= len(_rows(domain, "eval")) <= 128


@pytest.mark.parametrize("domain", DOMAINS)
def test_sft_rl_and_eval_prompts_are_disjoint(domain):
    prompts = {split: [r["prompt"] for r in _rows(domain, split)] for split in SPLITS}
    for split, rows in prompts.items():
        assert len(set(rows)) == len(rows), f"{split} repeats a prompt"
    assert not set(prompts["sft"]) & set(prompts["train"])
    assert not set(prompts["sft"]) & set(prompts["eval"])
    assert not set(prompts["train"]) & set(prompts["eval"])


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_reference_response_scores_one_and_every_habit_zero(domain):
    # SFT rows marked "habit" show the SFT teacher's habitual mistake (what RL should unlearn);
    # every other row's response is right. RL and eval rows never carry the habit.
    rows = [row for split in SPLITS for row in _rows(domain, split)]
    assert not any(r.get("habit") for split in ("train", "eval") for r in _rows(domain, split))
    if domain == "code":
        rows = _eval_rows_and_a_sample_of_each_program_shape(rows)
    kwargs = {"all_or_nothing": True} if domain == "instruction_following" else {}  # as cascade.yaml scores it
    reward = build_reward(domain, kwargs)
    scores, errors = score_batch(reward, [r["response"] for r in rows], rows, timeout_s=30)
    assert errors == 0
    bad = [(r["prompt"], r["response"], s) for r, s in zip(rows, scores) if s != (0.0 if r.get("habit") else 1.0)]
    assert not bad, bad[:5]


def _eval_rows_and_a_sample_of_each_program_shape(rows):
    """Every eval row, and ``CODE_ROWS_PER_SHAPE`` seeded picks among the other rows of each program
    shape (the response with its numbers blanked, habit or not): every template make_data.py has."""
    eval_prompts = {r["prompt"] for r in _rows("code", "eval")}
    by_shape = {}
    for row in rows:
        if row["prompt"] not in eval_prompts:
            by_shape.setdefault((re.sub(r"\d+", "N", row["response"]), bool(row.get("habit"))), []).append(row)
    assert len(by_shape) >= 6  # three operations, each right and habitual
    rng = random.Random(0)
    picked = [r for group in by_shape.values() for r in rng.sample(group, min(CODE_ROWS_PER_SHAPE, len(group)))]
    return [r for r in rows if r["prompt"] in eval_prompts] + picked


@pytest.mark.parametrize("domain", DOMAINS)
def test_sft_rows_show_the_habit_about_as_often_as_make_data_says(domain):
    make_data = _make_data()
    decisions = make_data.BUILDERS[domain](random.Random(0))[0][2]
    rows = _rows(domain, "sft")
    habit = sum(bool(r.get("habit")) for r in rows) / len(rows)
    assert abs(habit - (1 - make_data.SFT_FOLLOWS[domain] ** decisions)) < 0.05


def _wrong_decisions(domain, row):
    """Which of a math or IF row's three decisions its response gets wrong (0-based)."""
    response = row["response"]
    if domain == "math":  # the thousands, hundreds and tens digits (each carries one carry)
        return [i for i in range(3) if response[i] != row["answer"][i]]
    body = response.strip('"')
    words = body.removesuffix(" OK").split(" ")
    closing = response.endswith(" OK") if "end with ok" in row["prompt"] else response.startswith('"')
    return [i for i, ok in enumerate((words[0].isupper(), words[1].isupper(), closing)) if not ok]


@pytest.mark.parametrize("domain", ["math", "instruction_following"])
def test_habits_are_spread_over_three_positions_independently(domain):
    """A sequence reward is sparse here and a per-token signal is not: the SFT rows' mistakes sit at
    three places, each wrong on its own at about 1 - SFT_FOLLOWS, so a row is right only when all are."""
    rows = _rows(domain, "sft")
    wrong = [_wrong_decisions(domain, r) for r in rows]
    assert all(bool(w) == bool(r.get("habit")) for w, r in zip(wrong, rows))
    rate = 1 - _make_data().SFT_FOLLOWS[domain]
    for position in range(3):
        assert abs(sum(position in w for w in wrong) / len(rows) - rate) < 0.05
    counts = [sum(len(w) == k for w in wrong) / len(rows) for k in range(4)]
    expected = [math.comb(3, k) * rate**k * (1 - rate) ** (3 - k) for k in range(4)]
    assert all(abs(c - e) < 0.05 for c, e in zip(counts, expected)), (counts, expected)


@pytest.mark.parametrize("domain", DOMAINS)
def test_a_wrong_response_does_not_score_one(domain):
    # The verifiers actually discriminate on this data (not everything scores 1).
    rows = _rows(domain, "eval")
    wrong = [rows[(i + 1) % len(rows)]["response"] for i in range(len(rows))]
    scores, _ = score_batch(get_reward(domain), wrong, rows, timeout_s=30)
    assert sum(s == 1.0 for s in scores) < len(rows) / 2
