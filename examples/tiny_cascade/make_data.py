"""Synthetic data for the tiny CPU cascade: three domains small enough for a char-level GPT.

    python examples/tiny_cascade/make_data.py --out examples/tiny_cascade/data [--seed 0]

writes ``<domain>_sft.jsonl`` (SFT rows), ``<domain>_train.jsonl`` (RL prompts) and
``<domain>_eval.jsonl`` (held out) for ``math``, ``instruction_following`` and ``code``. One JSON
object per line::

    {"domain": ..., "prompt": <user message>, "response": <reference answer (SFT target)>, <reward fields>}

Reward fields (what ``megatron_cascade.rewards.get_reward(domain)`` reads):

* math: ``"answer"`` -- "a+b=" -> "c" with a, b in [0, 30) (greedy-scored by math-verify);
* instruction_following: ``"instructions"`` -- IFEval ids with kwargs; the score is the fraction
  followed (e.g. "say cat in caps" -> "CAT": change_case:english_capital + keywords:existence);
  12 words x 5 formats, split by (word, format) pair;
* code: ``"tests"`` -- stdin -> stdout checks of the last ```python block (all must pass).

The three splits are prompt-disjoint items of the same task families: RL trains on prompts the SFT
stage never saw (as real pipelines do), so what RL gains carries over to the held-out eval set
instead of polishing memorised answers. The output is a pure
function of ``--seed`` (sorted keys, fixed row order), so the committed files can be regenerated
byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DOMAINS = ("math", "instruction_following", "code")
EVAL_ROWS = {"math": 48, "instruction_following": 20, "code": 32}

WORDS = ("cat", "dog", "sun", "red", "box", "cup", "hat", "pen", "map", "egg", "fox", "owl", "bee",
         "ant", "car", "bus", "key", "toy", "jam", "ice", "sky", "sea", "tea", "pie", "bag", "bed",
         "fan", "net", "pot", "rug", "cow", "pig", "hen", "bat", "elk", "yak", "gum", "ink", "oak", "web")


def math_items(rng: random.Random) -> list[dict]:
    rows = []
    for a in range(30):
        for b in range(30):
            rows.append({"prompt": f"{a}+{b}=", "response": str(a + b), "answer": str(a + b)})
    return rows


def _kw(word: str) -> dict:
    return {"id": "keywords:existence", "kwargs": {"keywords": [word]}}


# Instruction following draws on a few words only: copying an arbitrary word is beyond a tiny model
# in minutes, but following an instruction it has not seen with that word (a held-out word x format
# pair) is a choice it can learn, and that is what the RL stage should improve.
IF_WORDS = WORDS[:12]


def if_items(rng: random.Random) -> list[dict]:
    rows = []
    for w in IF_WORDS:
        rows.append({"prompt": f"say {w} in caps", "response": w.upper(),
                     "instructions": [{"id": "change_case:english_capital", "kwargs": {}}, _kw(w)]})
        rows.append({"prompt": f"say {w} and end with ok", "response": f"{w} ok",
                     "instructions": [_kw(w), {"id": "startend:end_checker", "kwargs": {"end_phrase": "ok"}}]})
        rows.append({"prompt": f"say {w} in quotes", "response": f'"{w}"',
                     "instructions": [{"id": "startend:quotation", "kwargs": {}}, _kw(w)]})
        for k in (2, 3):
            rows.append({"prompt": f"say {w} {k} times", "response": " ".join([w] * k),
                         "instructions": [{"id": "keywords:frequency",
                                           "kwargs": {"keyword": w, "frequency": k, "relation": "at least"}},
                                          {"id": "punctuation:no_comma", "kwargs": {}}]})
    return rows


def _program(body: str) -> str:
    return f"```python\n{body}\n```"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 6)))


def code_items(rng: random.Random) -> list[dict]:
    families = []  # (prompt, program, stdin -> stdout, input kind)
    for k in range(1, 41):
        families.append((f"add {k} to n", f"print(int(input())+{k})", lambda x, k=k: str(int(x) + k), "int"))
    for k in range(1, 31):
        families.append((f"subtract {k} from n", f"print(int(input())-{k})", lambda x, k=k: str(int(x) - k), "int"))
    for k in range(2, 21):
        families.append((f"multiply n by {k}", f"print(int(input())*{k})", lambda x, k=k: str(int(x) * k), "int"))
    for k in range(2, 10):
        families.append((f"print s {k} times", f"print(input()*{k})", lambda x, k=k: x * k, "str"))
    families.append(("reverse s", "print(input()[::-1])", lambda x: x[::-1], "str"))
    families.append(("print s in caps", "print(input().upper())", lambda x: x.upper(), "str"))
    families.append(("print the length of s", "print(len(input()))", lambda x: str(len(x)), "str"))
    rows = []
    for prompt, body, fn, kind in families:
        inputs = [str(rng.randint(0, 99)) if kind == "int" else _word(rng) for _ in range(2)]
        rows.append({"prompt": prompt, "response": _program(body),
                     "tests": [{"input": x + "\n", "output": fn(x) + "\n"} for x in inputs]})
    return rows


BUILDERS = {"math": math_items, "instruction_following": if_items, "code": code_items}


def make_domain(domain: str, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(sft rows, RL train rows, eval rows) of one domain, prompt-disjoint."""
    rng = random.Random(f"{seed}:{domain}")
    items = [{"domain": domain, **row} for row in BUILDERS[domain](rng)]
    order = list(range(len(items)))
    rng.shuffle(order)
    n_eval = EVAL_ROWS[domain]
    # code: the three fixed string families (the last items) always stay in train.
    eligible = [i for i in order if domain != "code" or i < len(items) - 3]
    eval_idx = eligible[:n_eval]
    chosen = set(eval_idx)
    rest = [i for i in order if i not in chosen]
    # code: the fixed string families (always outside eval) go to SFT, the rest alternate.
    fixed = {len(items) - 3, len(items) - 2, len(items) - 1} if domain == "code" else set()
    sft = [items[i] for k, i in enumerate(rest) if i in fixed or (k % 2 == 0 and i not in fixed)]
    train = [items[i] for k, i in enumerate(rest) if i not in fixed and k % 2 == 1]
    evals = [items[i] for i in eval_idx]
    return sft, train, evals


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def generate(out: Path, seed: int = 0) -> list[Path]:
    """Write the nine files into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for domain in DOMAINS:
        sft, train, evals = make_domain(domain, seed)
        for split, rows in (("sft", sft), ("train", train), ("eval", evals)):
            path = out / f"{domain}_{split}.jsonl"
            write_jsonl(path, rows)
            paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in generate(args.out, args.seed):
        print(path)


if __name__ == "__main__":
    main()
