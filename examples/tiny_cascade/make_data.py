"""Synthetic data for the tiny CPU cascade: three domains small enough for a char-level GPT.

    python examples/tiny_cascade/make_data.py --out examples/tiny_cascade/data [--seed 0]

writes ``<domain>_sft.jsonl`` (SFT rows), ``<domain>_train.jsonl`` (RL prompts) and
``<domain>_eval.jsonl`` (held out) for ``math``, ``instruction_following`` and ``code``. One JSON
object per line::

    {"domain": ..., "prompt": <user message>, "response": <reference answer (SFT target)>, <reward fields>}

Reward fields (what ``megatron_cascade.rewards.get_reward(domain)`` reads):

* math: ``"answer"`` -- "a+b=" -> "c", two four-digit numbers whose sum carries three times
  ("4357+2285=" -> "6642"; math-verify);
* instruction_following: ``"instructions"`` -- IFEval ids with kwargs; the score is the fraction
  followed, or all-or-nothing as cascade.yaml scores it ("say cat dog in caps and end with ok" ->
  "CAT DOG OK": change_case:english_capital + keywords:existence x 2 + startend:end_checker; or
  "... in caps in quotes" -> '"CAT DOG"'); pairs of 800 words;
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
# Chance that an SFT row shows the right behaviour at each of its decisions (the domain's habit,
# below, otherwise): code has one decision per answer, math and instruction following three.
SFT_FOLLOWS = {"math": 0.35, "instruction_following": 0.35, "code": 0.4}
# Items per domain (distinct prompts): math of 2.5M four-digit sums, IF of 1.3M (word pair, format) items.
MATH_ITEMS = 4000
IF_ITEMS = 3000

# Consonant-vowel-consonant words (of 1,445): copying one is a skill, not a memorised answer. With 120
# words (600 items) the SFT model memorised its rows and copied a held-out word right 5% of the time;
# with 800 it copies it (the errors left after SFT are mostly the habit, which is what RL removes).
N_WORDS = 800
# Code constants k in [1, CODE_K_MAX): three digits to copy, 3,000 items (with k < 100 the SFT model
# memorised them: +42 came out as +40 or +32).
CODE_K_MAX = 1000


# Each item is (prompt, render, decisions, reward fields): ``render(follows)`` is the response with
# each of its ``decisions`` right or habitual as ``follows`` says. The SFT teacher has a habit: each
# decision of an SFT row is right with probability SFT_FOLLOWS[domain], on its own, so the SFT policy
# knows both behaviours at every place and gets a whole answer right rarely (pass@1 low, pass@8 high).
# The choice does not depend on the prompt, so what RL learns on its prompts (drop the habit) carries
# over to held-out prompts of the same task. Math and IF answers hold three decisions: a sequence
# reward is right only when all are, while a teacher's per-token signal scores each where it is.

def _carrying_pairs() -> list[tuple[int, int]]:
    """Digit pairs (x, y) whose sum carries (>= 10)."""
    return [(x, y) for x in range(10) for y in range(10) if x + y >= 10]


def math_items(rng: random.Random) -> list[tuple]:
    """Four-digit sums with three carries ("4357+2285=" -> "6642"): the units, tens and hundreds digits
    of each pair sum to 10 or more (so each carries whatever comes in), the thousands to at most 8.
    The habit forgets each carry on its own (the tens, hundreds or thousands digit one lower): the
    errors sit at three positions, so a whole answer is right only when all three are."""
    thousands = [(x, y) for x in range(1, 9) for y in range(1, 9) if x + y <= 8]
    pairs = _carrying_pairs()
    rows = []
    for _ in range(MATH_ITEMS):
        (ak, bk), (ah, bh), (at, bt), (au, bu) = rng.choice(thousands), *(rng.choice(pairs) for _ in range(3))
        a, b = ak * 1000 + ah * 100 + at * 10 + au, bk * 1000 + bh * 100 + bt * 10 + bu
        digits = [str(ak + bk + 1), str((ah + bh + 1) % 10), str((at + bt + 1) % 10), str((au + bu) % 10)]
        forgot = [str(ak + bk), str((ah + bh) % 10), str((at + bt) % 10)]  # the digit without its carry

        def render(follows: tuple[bool, ...], digits=digits, forgot=forgot) -> str:
            return "".join(d if ok else f for d, f, ok in zip(digits, forgot, follows)) + digits[3]

        rows.append((f"{a}+{b}=", render, 3, {"answer": str(a + b)}))
    return list({row[0]: row for row in rows}.values())  # one item per prompt


def _kw(word: str) -> dict:
    return {"id": "keywords:existence", "kwargs": {"keywords": [word]}}


def _two_words(w1: str, w2: str, follows: tuple[bool, ...]) -> str:
    """The two words, each in capitals where its decision (``follows[0]``, ``follows[1]``) is right."""
    return " ".join(w.upper() if ok else w for w, ok in zip((w1, w2), follows))


def if_items(rng: random.Random) -> list[tuple]:
    """Two words in capitals, ending with OK ("say cat dog in caps and end with ok" -> "CAT DOG OK"), or
    in capitals and in quotes ('"CAT DOG"'). The habit, on its own at each of three places: a word
    left in lower case, the OK or the quotes left out."""
    words: set[str] = set()
    while len(words) < N_WORDS:
        word = rng.choice("bcdfghklmnprstvwz") + rng.choice("aeiou") + rng.choice("bcdfghklmnprstvwz")
        if not word.endswith("ok"):  # a word ending in ok would satisfy the end check by itself
            words.add(word)
    words_sorted = sorted(words)
    caps = {"id": "change_case:english_capital", "kwargs": {}}
    rows = {}
    while len(rows) < IF_ITEMS:
        w1, w2 = rng.sample(words_sorted, 2)
        if rng.random() < 0.5:
            prompt, closing = f"say {w1} {w2} in caps and end with ok", {"id": "startend:end_checker",
                                                                        "kwargs": {"end_phrase": "ok"}}

            def render(f: tuple[bool, ...], w1=w1, w2=w2) -> str:
                return _two_words(w1, w2, f) + (" OK" if f[2] else "")
        else:
            prompt, closing = f"say {w1} {w2} in caps in quotes", {"id": "startend:quotation", "kwargs": {}}

            def render(f: tuple[bool, ...], w1=w1, w2=w2) -> str:
                return f'"{_two_words(w1, w2, f)}"' if f[2] else _two_words(w1, w2, f)
        rows[prompt] = (prompt, render, 3, {"instructions": [caps, _kw(w1), _kw(w2), closing]})
    return [rows[k] for k in sorted(rows)]


def _program(body: str) -> str:
    return f"```python\n{body}\n```"


def _one_decision(right: str, habitual: str):
    """The render of an item with one decision: the right response or the habitual one."""
    return lambda follows: right if follows[0] else habitual


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
        rows.append((prompt, _one_decision(_program(f"print(int(input()){op}{k})"), _program(f"print(input(){op}{k})")),
                     1, {"tests": tests}))
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
    return prompt, _one_decision(str(key), str(box)), 1, {"answer": str(key)}


def make_long_context(seed: int) -> dict[str, list[dict]]:
    """{split: rows} of the long-context task (SFT rows show the distractor habit like the others)."""
    rng = random.Random(f"{seed}:long_context")
    out = {}
    for split, count in LONG_ROWS.items():
        out[split] = [_row("long_context", long_context_item(rng),
                           (split != "sft" or rng.random() < LONG_SFT_FOLLOWS,)) for _ in range(count)]
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


def _row(domain: str, item: tuple, follows: tuple[bool, ...] = ()) -> dict:
    """The row of ``item``: its response with each decision right where ``follows`` says (all right
    when empty), marked ``habit`` when any is not."""
    prompt, render, decisions, fields = item
    follows = follows or (True,) * decisions
    row = {"domain": domain, "prompt": prompt, "response": render(follows), **fields}
    if not all(follows):
        row["habit"] = True  # the SFT target shows the habitual mistake somewhere (scores 0)
    return row


def make_domain(domain: str, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(sft rows, RL train rows, eval rows) of one domain, prompt-disjoint. The items go one third to
    RL and two thirds to SFT (after the eval rows); an SFT row gets each of its decisions right with
    probability ``SFT_FOLLOWS[domain]``, on its own; RL and eval rows carry the right response."""
    rng = random.Random(f"{seed}:{domain}")
    items = BUILDERS[domain](rng)
    order = list(range(len(items)))
    rng.shuffle(order)
    n_eval = EVAL_ROWS[domain]
    eval_idx, rest = order[:n_eval], order[n_eval:]
    sft_idx = [i for k, i in enumerate(rest) if k % 3 != 2]
    sft = [_row(domain, items[i], tuple(rng.random() < SFT_FOLLOWS[domain] for _ in range(items[i][2])))
           for i in sft_idx]
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
