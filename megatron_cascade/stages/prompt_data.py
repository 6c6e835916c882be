"""Prompt datasets: JSONL rows per domain, validated, and a deterministic weighted mixer.

A row is one JSON object: ``prompt`` (str) or ``messages`` (chat list), optional ``domain``
(must match the domain it is listed under), ``response`` (the SFT target), ``tools`` (JSON schemas of
the tools the model may call, rendered by the tokenizer's chat template), and whatever fields the
domain's reward reads (``answer``, ``tests``, ``instructions``, ``schema``...). A malformed row (bytes
that are not UTF-8, invalid JSON, missing fields...) is reported with ``file:line`` and skipped, or
stops the run, per ``data.on_bad_row``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from megatron_cascade.config.model import ConfigError
from megatron_cascade.config.schema import OnBadRow
from megatron_cascade.rewards.registry import EPISODE_RECORD

log = logging.getLogger(__name__)

RowCheck = Callable[[dict], None]  # raises ValueError naming what the row lacks


class DataError(ValueError):
    """A data row or file that cannot be used; the message names file:line."""


@dataclass(frozen=True)
class Example:
    """One prompt, tokenised, with its raw row (the reward reads it)."""

    domain: str
    prompt_ids: tuple[int, ...]
    row: dict
    source: str  # file:line

    @property
    def response(self) -> Optional[str]:
        return self.row.get("response")


def _messages(row: dict) -> list[dict]:
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in messages):
            raise DataError("'messages' must be a list of {role, content} objects")
        return messages
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise DataError("a row needs a non-empty string 'prompt' or a 'messages' list")
    return [{"role": "user", "content": prompt}]


def _tools(row: dict) -> Optional[list[dict]]:
    """The row's ``tools`` (JSON schemas for the chat template), or None when it declares none."""
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"'tools' must be a list of JSON objects (tool schemas), got {json.dumps(tools)[:200]}")
    return tools


def _decode(raw: bytes) -> str:
    """One line of a JSONL file as text; bytes that are not UTF-8 make the row bad (not the file)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"not valid UTF-8: byte 0x{raw[exc.start]:02x} at column {exc.start + 1} "
                        f"({exc.reason})") from None


def _parse_row(raw: bytes, domain: str, tokenizer, need_response: bool, max_prompt_tokens: int,
               check_row: Optional[RowCheck]) -> Example:
    line = _decode(raw)
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(row, dict):
        raise DataError("a row must be a JSON object")
    if row.get("domain", domain) != domain:
        raise DataError(f"row says domain {row['domain']!r} but is listed under domain {domain!r}")
    if EPISODE_RECORD in row:
        raise DataError(f"a row may not hold {EPISODE_RECORD!r}: the key is the runner's record of an episode")
    if check_row is not None:
        try:
            check_row(row)
        except ValueError as exc:  # the domain's environment cannot run this row (e.g. an unknown tool)
            raise DataError(str(exc)) from None
    if need_response and not isinstance(row.get("response"), str):
        raise DataError("an sft stage needs a string 'response' in every row")
    messages, tools = _messages(row), _tools(row)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except Exception as exc:  # noqa: BLE001 - tokenizer errors name the bad character etc.
        raise DataError(f"cannot tokenise the prompt: {exc}") from None
    if len(ids) > max_prompt_tokens:
        raise DataError(f"prompt has {len(ids)} tokens > data.max_prompt_tokens={max_prompt_tokens}")
    return Example(domain, tuple(ids), row, "")


def parse_rows(path: str, domain: str, tokenizer, *, need_response: bool = False, max_prompt_tokens: int = 512,
               digest=None, check_row: Optional[RowCheck] = None) -> Iterator[Example | DataError]:
    """Each non-empty row of the JSONL file ``path`` as an ``Example``, or a ``DataError`` naming
    ``path:line`` and what is wrong with it. Raises ``DataError`` when the file cannot be opened.
    ``digest``: a ``hashlib`` object fed every byte of the file as it is read (read to the end).
    ``check_row``: the domain environment's check of a row (its ``ValueError`` makes the row bad)."""
    try:
        # Binary: a line that is not UTF-8 is one bad row reported as path:line, not a crash of the read.
        handle = open(path, "rb")
    except OSError as exc:
        raise DataError(f"{path}: cannot open data file: {exc.strerror}") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if digest is not None:
                digest.update(line)
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                example = _parse_row(line, domain, tokenizer, need_response, max_prompt_tokens, check_row)
            except DataError as exc:
                error = DataError(f"{where}: {exc}")
                error.where, error.problem = where, str(exc)
                yield error
                continue
            yield Example(example.domain, example.prompt_ids, example.row, where)


def load_examples(path: str, domain: str, tokenizer, *, on_bad_row: str = "skip", need_response: bool = False,
                  max_prompt_tokens: int = 512, digest=None, check_row: Optional[RowCheck] = None) -> list[Example]:
    """Read a JSONL file of ``domain``; bad rows are reported with ``path:line`` and skipped or fatal.
    ``digest``, ``check_row``: as for ``parse_rows`` (a stage's checkpoints record its data files' SHA-256)."""
    if on_bad_row not in OnBadRow.values():
        raise ConfigError(f"data.on_bad_row={on_bad_row!r} is not one of {OnBadRow.values()}")
    examples, bad = [], 0
    for row in parse_rows(path, domain, tokenizer, need_response=need_response, max_prompt_tokens=max_prompt_tokens,
                          digest=digest, check_row=check_row):
        if isinstance(row, DataError):
            if on_bad_row == "error":
                raise row
            log.warning("%s: skipping bad row: %s", row.where, row.problem)
            bad += 1
            continue
        examples.append(row)
    if not examples:
        raise DataError(f"{path}: no usable rows ({bad} bad)")
    if bad:
        log.warning("%s: %d bad row(s) skipped, %d used", path, bad, len(examples))
    return examples


class PromptMixer:
    """Draws a step's prompts from several domains by weight, deterministically from (seed, step).

    The same (seed, step) always gives the same prompts, on every rank and after a resume, so the
    data position of a run is just its step number.
    """

    def __init__(self, datasets: dict[str, list[Example]], weights: dict[str, float], seed: int) -> None:
        self.domains = sorted(weights)
        missing = [d for d in self.domains if not datasets.get(d)]
        if missing:
            raise DataError(f"no examples for domain(s) {missing}")
        self.datasets = datasets
        total = sum(weights[d] for d in self.domains)
        self.probs = torch.tensor([weights[d] / total for d in self.domains], dtype=torch.float64)
        self.seed = seed

    def draw(self, step: int, count: int, round: int = 0) -> list[Example]:
        """``count`` examples for ``step``: domains by weight, examples uniformly within a domain.
        ``round`` > 0: a further independent draw for the same step (dynamic sampling's extra rounds)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + round * 7_368_787)
        picks = torch.multinomial(self.probs, count, replacement=True, generator=gen).tolist()
        out = []
        for index in picks:
            pool = self.datasets[self.domains[index]]
            out.append(pool[int(torch.randint(len(pool), (1,), generator=gen))])
        return out

