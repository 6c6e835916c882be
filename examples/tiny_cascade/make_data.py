"""Synthetic data for the tiny CPU cascade: three domains small enough for a char-level GPT.

    python examples/tiny_cascade/make_data.py --out examples/tiny_cascade/data [--seed 0]

writes ``<domain>_sft.jsonl`` (SFT rows), ``<domain>_train.jsonl`` (RL prompts) and
``<domain>_eval.jsonl`` (held out) for ``math``, ``instruction_following`` and ``code``. One JSON
object per line::

    {"domain": ..., "prompt": <user message>, "response": <reference answer (SFT target)>, <reward fields>}

Reward fields (what ``megatron_cascade.rewards.get_reward(domain)`` reads):

* math: ``"answer"`` -- "a+b=" -> "c", a three-digit a plus a one-digit b that carries (math-verify);
* instruction_following: ``"instructions"`` -- IFEval ids with kwargs; the score is the fraction
  followed (e.g. "say cat in caps" -> "CAT": change_case:english_capital + keywords:existence);
  800 words x 5 formats, split by (word, format) pair;
* code: ``"tests"`` -- stdin -> stdout checks of the last ```python block (all must pass).

``--long`` writes the long-context task instead (``examples/tiny_cascade/long.yaml``):
``long_context_{sft,train,eval}.jsonl``, prompts of 1,000-2,000 characters (one token each with the
builtin char tokenizer) that hide ``key=NN`` among filler words and a distractor ``box=MM``, ending
in "what is key?": the answer is NN (the ``math`` reward); the habit answers the distractor.

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
# Held-out rows per domain: 128 x 8 samples puts the standard error of a score near 0.9 at ~0.01, small
# enough to tell a student 0.03 below its teacher; code stays at 48 (every sample runs in the sandbox).
EVAL_ROWS = {"math": 128, "instruction_following": 128, "code": 48}
# Fraction of SFT rows that show the right behaviour; the rest show the domain's habit (below).
SFT_FOLLOWS = 0.4

# Consonant-vowel-consonant words (of 1,445): copying one is a skill, not a memorised answer. With 120
# words (600 items) the SFT model memorised its rows and copied a held-out word right 5% of the time;
# with 800 it copies it (the errors left after SFT are mostly the habit, which is what RL removes).
N_WORDS = 800
# Code constants k in [1, CODE_K_MAX): three digits to copy, 3,000 items (with k < 100 the SFT model
# memorised them: +42 came out as +40 or +32).
CODE_K_MAX = 1000


# Each item is (prompt, right response, habitual response, reward fields). The SFT teacher has a habit:
# it gives the right response to SFT_FOLLOWS of its rows and the habitual mistake to the others, so
# the SFT policy knows both behaviours and picks the right one about a third of the time on any prompt
# (pass@1 low, pass@8 high). The choice does not depend on the prompt, so what RL learns on its
# prompts (drop the habit) carries over to held-out prompts of the same task.

def math_items(rng: random.Random) -> list[tuple]:
    """Three-digit + one-digit additions that carry into the tens ("347+5=" -> "352"); the habit forgets
    the carry ("342"). Tens digits 1..8, so the carry never reaches the hundreds. (SFT rows without a
    carry, always right, made the habit near certain: pass@8 0.05 after SFT; two-digit sums alone, 360
    items, were memorised: 20% of held-out answers wrong in other ways after SFT, 4% with 3,240.)"""
    rows = []
    for hundreds in range(100, 1000, 100):
        for a in range(hundreds + 10, hundreds + 90):
            for b in range(10 - a % 10, 10):
                rows.append((f"{a}+{b}=", str(a + b), str(a + b - 10), {"answer": str(a + b)}))
    return rows


def _kw(word: str) -> dict:
    return {"id": "keywords:existence", "kwargs": {"keywords": [word]}}


def if_items(rng: random.Random) -> list[tuple]:
    """A word in one of five formats ("say cat in caps" -> "CAT"); the habit ignores the format ("cat")."""
    words: set[str] = set()
    while len(words) < N_WORDS:
        word = rng.choice("bcdfghklmnprstvwz") + rng.choice("aeiou") + rng.choice("bcdfghklmnprstvwz")
        if not word.endswith("ok"):  # "say wok and end with ok": the habit "wok" would already end with ok
            words.add(word)
    rows = []
    for w in sorted(words):
        rows.append((f"say {w} in caps", w.upper(), w,
                     {"instructions": [{"id": "change_case:english_capital", "kwargs": {}}, _kw(w)]}))
        rows.append((f"say {w} and end with ok", f"{w} ok", w,
                     {"instructions": [_kw(w), {"id": "startend:end_checker", "kwargs": {"end_phrase": "ok"}}]}))
        rows.append((f"say {w} in quotes", f'"{w}"', w,
                     {"instructions": [{"id": "startend:quotation", "kwargs": {}}, _kw(w)]}))
        for k in (2, 3):
            rows.append((f"say {w} {k} times", " ".join([w] * k), w,
                         {"instructions": [{"id": "keywords:frequency",
                                            "kwargs": {"keyword": w, "frequency": k, "relation": "at least"}},
                                           {"id": "punctuation:no_comma", "kwargs": {}}]}))
    return rows


def _program(body: str) -> str:
    return f"```python\n{body}\n```"


def code_items(rng: random.Random) -> list[tuple]:
    """stdin -> stdout arithmetic on n ("add 7 to n" -> print(int(input())+7)); the habit forgets the
    int() (a TypeError, or the string repeated)."""
    families = []  # (prompt, operator, k)
    families += [(f"add {k} to n", "+", k) for k in range(1, CODE_K_MAX)]
    families += [(f"subtract {k} from n", "-", k) for k in range(1, CODE_K_MAX)]
    families += [(f"multiply n by {k}", "*", k) for k in range(2, CODE_K_MAX)]
    apply = {"+": lambda x, k: x + k, "-": lambda x, k: x - k, "*": lambda x, k: x * k}
    rows = []
    for prompt, op, k in families:
        inputs = [rng.randint(0, 99) for _ in range(2)]
        tests = [{"input": f"{x}\n", "output": f"{apply[op](x, k)}\n"} for x in inputs]
        rows.append((prompt, _program(f"print(int(input()){op}{k})"), _program(f"print(input(){op}{k})"),
                     {"tests": tests}))
    return rows


LONG_ROWS = {"sft": 48, "train": 48, "eval": 16}
LONG_CHARS = (1000, 2000)  # prompt length range (characters = tokens with builtin:char)
LONG_SFT_FOLLOWS = 0.3  # the long task's own (the other domains' tuning leaves its data unchanged)
FILLER_WORDS = ("cat", "dog", "sun", "red", "box", "cup", "hat", "pen", "map", "egg", "fox", "owl", "bee",
                "ant", "car", "bus", "toy", "jam", "ice", "sky", "sea", "tea", "pie", "bag", "bed", "fan",
                "net", "pot", "rug", "cow", "pig", "hen", "bat", "elk", "yak", "gum", "ink", "oak", "web")


def long_context_item(rng: random.Random) -> tuple:
    """Filler words with ``key=NN`` and a distractor ``box=MM`` at random places, then the question."""
    key, box = rng.sample(range(10, 100), 2)
    facts = (f"key={key}.", f"box={box}.")
    filler = rng.randint(*LONG_CHARS) - len(" what is key?") - sum(len(f) + 1 for f in facts)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < filler:
        words.append(rng.choice(FILLER_WORDS))
    for fact in facts:
        words.insert(rng.randrange(len(words) + 1), fact)
    prompt = " ".join(words) + " what is key?"
    return prompt, str(key), str(box), {"answer": str(key)}


def make_long_context(seed: int) -> dict[str, list[dict]]:
    """{split: rows} of the long-context task (SFT rows show the distractor habit like the others)."""
    rng = random.Random(f"{seed}:long_context")
    out = {}
    for split, count in LONG_ROWS.items():
        out[split] = [_row("long_context", long_context_item(rng),
                           habit=split == "sft" and rng.random() >= LONG_SFT_FOLLOWS) for _ in range(count)]
    return out


def generate_long(out: Path, seed: int = 0) -> list[Path]:
    """Write the three long-context files into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, rows in make_long_context(seed).items():
        path = out / f"long_context_{split}.jsonl"
        write_jsonl(path, rows)
        paths.append(path)
    return paths


BUILDERS = {"math": math_items, "instruction_following": if_items, "code": code_items}


def _row(domain: str, item: tuple, habit: bool = False) -> dict:
    prompt, right, habitual, fields = item
    habit = habit and habitual is not None
    row = {"domain": domain, "prompt": prompt, "response": habitual if habit else right, **fields}
    if habit:
        row["habit"] = True  # the SFT target is the habitual mistake (scores 0)
    return row


def make_domain(domain: str, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(sft rows, RL train rows, eval rows) of one domain, prompt-disjoint. The task items (those with
    a habit) go one third to RL and two thirds to SFT (after the eval rows); SFT rows show the habit
    with probability 1 - SFT_FOLLOWS; RL and eval rows carry the right response; items without a
    habit are SFT-only."""
    rng = random.Random(f"{seed}:{domain}")
    items = BUILDERS[domain](rng)
    order = [i for i in range(len(items)) if items[i][2] is not None]
    rng.shuffle(order)
    n_eval = EVAL_ROWS[domain]
    eval_idx, rest = order[:n_eval], order[n_eval:]
    sft_idx = [i for k, i in enumerate(rest) if k % 3 != 2] + [i for i, item in enumerate(items) if item[2] is None]
    sft = [_row(domain, items[i], habit=rng.random() >= SFT_FOLLOWS) for i in sft_idx]
    train = [_row(domain, items[i]) for i in rest[2::3]]
    evals = [_row(domain, items[i]) for i in eval_idx]
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
    parser.add_argument("--long", action="store_true", help="write the long-context task (long.yaml) instead")
    args = parser.parse_args(argv)
    for path in (generate_long if args.long else generate)(args.out, args.seed):
        print(path)


if __name__ == "__main__":
    main()
