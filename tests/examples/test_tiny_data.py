"""The tiny-cascade data: reproducible from make_data.py, verifiable, held-out eval sets."""

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_cascade.rewards import get_reward, score_batch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade"
DATA = EXAMPLE / "data"
DOMAINS = ("math", "instruction_following", "code")
REWARD_FIELD = {"math": "answer", "instruction_following": "instructions", "code": "tests"}


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
    assert names == sorted(f"{d}_{s}.jsonl" for d in DOMAINS for s in ("train", "eval"))
    for name in names:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), \
            f"{name} is stale: rerun python examples/tiny_cascade/make_data.py"
    assert sum(p.stat().st_size for p in DATA.iterdir()) < 2 * 1024 * 1024


def test_another_seed_gives_another_split(tmp_path):
    _make_data().main(["--out", str(tmp_path), "--seed", "1"])
    assert (tmp_path / "math_eval.jsonl").read_bytes() != (DATA / "math_eval.jsonl").read_bytes()


@pytest.mark.parametrize("domain", DOMAINS)
def test_rows_are_small_and_well_formed(domain):
    for split in ("train", "eval"):
        rows = _rows(domain, split)
        assert rows
        for row in rows:
            assert row["domain"] == domain and REWARD_FIELD[domain] in row
            assert 0 < len(row["prompt"]) <= 40 and 0 < len(row["response"]) <= 40
            (row["prompt"] + row["response"]).encode("ascii")  # char tokenizer vocabulary
    assert 32 <= len(_rows(domain, "eval")) <= 64


@pytest.mark.parametrize("domain", DOMAINS)
def test_eval_and_train_are_disjoint(domain):
    train = {r["prompt"] for r in _rows(domain, "train")}
    evals = [r["prompt"] for r in _rows(domain, "eval")]
    assert len(set(evals)) == len(evals)
    assert not train & set(evals)


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_reference_response_scores_one(domain):
    rows = _rows(domain, "train") + _rows(domain, "eval")
    scores, errors = score_batch(get_reward(domain), [r["response"] for r in rows], rows, timeout_s=30)
    assert errors == 0
    bad = [(r["prompt"], r["response"], s) for r, s in zip(rows, scores) if s != 1.0]
    assert not bad, bad[:5]


@pytest.mark.parametrize("domain", DOMAINS)
def test_a_wrong_response_does_not_score_one(domain):
    # The verifiers actually discriminate on this data (not everything scores 1).
    rows = _rows(domain, "eval")
    wrong = [rows[(i + 1) % len(rows)]["response"] for i in range(len(rows))]
    scores, _ = score_batch(get_reward(domain), wrong, rows, timeout_s=30)
    assert sum(s == 1.0 for s in scores) < len(rows) / 2
