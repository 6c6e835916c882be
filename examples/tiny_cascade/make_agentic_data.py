"""Synthetic data for the tiny agentic stage (``agentic.yaml``): multiplication with a calculator tool.

    python examples/tiny_cascade/make_agentic_data.py --out examples/tiny_cascade/data [--seed 0]

A prompt asks for a (four-digit) product of two 2-digit numbers, which the tiny model cannot compute
but can delegate: the intended episode is two model turns::

    <|user|>What is 37*23? Use the calculator.<eos><|assistant|>
    <tool_call>{"name":"calculator","arguments":{"expression":"37*23"}}</tool_call><eos>   (model)
    <|user|><tool_response>\\n851\\n</tool_response><eos><|assistant|>                       (tool)
    851<eos>                                                                                   (model)

Files (domain ``tool``):

* ``tool_sft.jsonl``: the traces cut into their two model turns, the per-turn SFT rows of a tool
  trace: ``{"prompt", "response": <the call>}`` and ``{"messages": [user, assistant call, user tool
  response], "response": <the answer>}`` — rendered by the chat template exactly as the
  ``tool_calling`` environment appends the tool's answer during RL;
* ``tool_train.jsonl`` / ``tool_eval.jsonl``: RL / held-out prompts with the row's tools (JSON
  schema), ``expected_calls`` and ``answer`` (what the ``tool_calling`` reward compares).

The three splits are disjoint in (a, b). The output is a pure function of ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CALCULATOR = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"], "additionalProperties": False}}
SPLITS = {"eval": 48, "sft": 800, "train": 400}  # items (an SFT item gives two rows)


def call_text(expression: str) -> str:
    """The model's tool call, compact JSON (fewer tokens for the char-level model)."""
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def tool_response_text(result: str) -> str:
    return f"<tool_response>\n{result}\n</tool_response>"


def rl_row(a: int, b: int) -> dict:
    expression = f"{a}*{b}"
    return {"domain": "tool", "prompt": f"What is {expression}? Use the calculator.", "tools": [CALCULATOR],
            "expected_calls": [{"name": "calculator", "arguments": {"expression": expression}}],
            "answer": str(a * b)}


def sft_rows(a: int, b: int) -> list[dict]:
    row = rl_row(a, b)
    call = call_text(f"{a}*{b}")
    first = {"domain": "tool", "prompt": row["prompt"], "response": call}
    second = {"domain": "tool", "response": row["answer"], "messages": [
        {"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": call},
        {"role": "user", "content": tool_response_text(row["answer"])}]}
    return [first, second]


def build(seed: int) -> dict[str, list[dict]]:
    # Four-digit products only: every prompt, call and answer has the same shape, so what the model
    # copies (the expression into the call, the tool's result into the answer) sits at a fixed offset.
    items = [(a, b) for a in range(10, 100) for b in range(10, 100) if a * b >= 1000]
    random.Random(seed).shuffle(items)
    out, start = {}, 0
    for split, count in SPLITS.items():
        chosen = items[start:start + count]
        start += count
        out[split] = [r for a, b in chosen for r in sft_rows(a, b)] if split == "sft" else [rl_row(a, b)
                                                                                               for a, b in chosen]
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in build(args.seed).items():
        write_jsonl(out / f"tool_{split}.jsonl", rows)


if __name__ == "__main__":
    main()
