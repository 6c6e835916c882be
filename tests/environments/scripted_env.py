"""A scripted environment for the episode tests (module level: worker processes import it by name).

Every letter, digit or space ends a model turn (turns are short even for a random tiny model); the
environment answers ``[obs k]`` as a user turn followed by the assistant prefix, gives 0.25 per step,
and ends the episode at its ``turns``-th step. A row with ``"hang": true`` sleeps ``hang_s`` seconds in
its second step (a tool that hangs), or with ``hang_in: start`` in ``start`` (a slow workspace setup).
"""

from __future__ import annotations

import string
import time

from megatron_cascade.environments import EnvStep, Environment


def observation(tokenizer, k: int) -> list[int]:
    return [tokenizer.role_id("user")] + tokenizer.encode(f"[obs {k}]") + [tokenizer.eos_id,
                                                                             tokenizer.role_id("assistant")]


class ScriptedEnv(Environment):
    stop_strings = tuple(string.ascii_letters + string.digits + " ")
    metric_names = ("steps",)

    def __init__(self, tokenizer, *, turns: int = 3, hang_s: float = 0.0, hang_in: str = "step") -> None:
        super().__init__(tokenizer)
        self.turns, self.hang_s, self.hang_in = turns, hang_s, hang_in
        self.finished: list[dict] = []  # states released by finish()

    def start(self, row: dict) -> dict:
        if row.get("hang") and self.hang_in == "start":
            time.sleep(self.hang_s)
        return {"row": row, "k": 0}

    def finish(self, state: dict) -> None:
        self.finished.append(state)

    def step(self, state: dict, action_ids, action_text: str) -> EnvStep:
        state["k"] += 1
        if state["row"].get("hang") and self.hang_in == "step" and state["k"] == 2:
            time.sleep(self.hang_s)
        if state["k"] >= self.turns:
            return EnvStep(done=True, reward=0.25, metrics={"steps": 1.0})
        return EnvStep(observation_ids=observation(self.tokenizer, state["k"]), reward=0.25, metrics={"steps": 1.0})


def parity(response: str, sample: dict) -> float:
    """A reward with spread inside a group (GRPO groups are informative): the transcript's parity."""
    return float(sum(map(ord, response)) % 2)
