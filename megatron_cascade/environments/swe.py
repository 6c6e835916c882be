"""``swe``: software-engineering episodes — fix a bug in a repository with tools, scored by hidden tests.

Each episode gets a fresh copy of its row's repository (:class:`~megatron_cascade.environments.swe_tools.Workspace`).
Every model turn may hold tool calls in the chat templates' format (``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, at most ``max_calls_per_turn``):

``view(path=".", start_line=1, end_line=null)``
    a folder's files, or a file's numbered lines;
``search(text, path=".")``
    the lines holding ``text``;
``edit(path, old, new)``
    replace the one occurrence of ``old`` by ``new`` (``old: ""`` creates a file);
``run(command)``
    a ``python ...`` command in a fresh code sandbox on the workspace (no network, own uid,
    rlimits, process-tree kill; ``command_timeout_s``); the files it changes are kept;
``submit()``
    end the episode.

Results come back as a tool-response turn. A turn without any tool call submits as well. With
``reasoning_markers`` (a reasoning model), calls are read only after the turn's reasoning. At
submission the row's hidden tests run with unittest (``test_timeout_s``) against the workspace, in the
sandbox, where the model's code cannot reach their verdict (``_swe_runner.py``: the tests run in a
process that never imports the repository; its code runs in another, and its results come back as
data); the episode's reward (this step's ``EnvStep.reward``) is 1 when every hidden test ran and
passed, else 0. An
episode that ends at its turn or token budget without submitting scores 0. A sandbox that cannot
run at all raises (the episode's reward is an error, not a 0).

The domain's ``reward`` adds to that score: use ``{name: environment}`` (0 for every transcript).

Rows (JSONL)::

    {"prompt": "<the issue and the tools>", "repo": {"calc.py": "...", "test_calc.py": "..."},
     "hidden_tests": {"test_hidden_calc.py": "..."}, "hidden_test_count": 4}

``test_modules`` (default: the hidden test files as module names) names what unittest loads;
``hidden_test_count`` (optional) is how many tests must run, so that a patch that makes a test
module vanish or stop early cannot pass.

Limit: hidden tests see the repository's objects as data (rebuilt as builtins) or opaque handles
(attributes, calls, items, ``len``, iteration, ``str``; no truth value, identity equality): tests that
compare the repository's own objects fail, and arguments cross as copies (a function's in-place change
of its argument is not seen). A patch that special-cases the tests' inputs passes, as under any test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megatron_cascade.environments.base import EnvStep, Environment, register_environment
from megatron_cascade.environments.chat import tool_turn_ids
from megatron_cascade.environments.swe_tools import SandboxRunner, ToolError, Workspace, module_name, normalize_path
from megatron_cascade.rewards.tool_calls import CLOSE, BadToolCall, ToolCall, parse_tool_calls
from megatron_cascade.rewards.reasoning import ReasoningParser
from megatron_cascade.rewards.sandbox import CodeSandbox

TOOLS_PROMPT = (
    "You are in a Python repository. Call tools as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:\n"
    "- view(path=\".\", start_line=1, end_line=null): list a folder or show a file's lines\n"
    "- search(text, path=\".\"): lines containing text\n"
    "- edit(path, old, new): replace the one occurrence of old by new (old \"\" creates a file)\n"
    "- run(command): run a python command, e.g. python -m unittest -v\n"
    "- submit(): finish; hidden tests then decide.\n"
)


@dataclass
class SWEState:
    """One episode: its workspace and row, and what it did so far."""

    workspace: Workspace
    row: dict
    tool_calls: int = 0
    resolved: Optional[bool] = None


def _positive(name: str, value: Any, integer: bool = False) -> None:
    ok = (isinstance(value, int) if integer else isinstance(value, (int, float))) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"environment swe: {name} must be a positive {'integer' if integer else 'number'}, "
                         f"got {value!r}")


def hidden_test_modules(row: dict) -> list[str]:
    """The unittest names of a row: its ``test_modules``, else its hidden test files as modules."""
    modules = row.get("test_modules")
    if modules is None:
        modules = [module_name(p) for p in sorted(row["hidden_tests"]) if p.endswith(".py")]
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) and m for m in modules):
        raise ValueError("a SWE row's 'test_modules' must be a non-empty list of module names")
    return modules


@register_environment("swe")
class SWEEnvironment(Environment):
    """See the module docstring. Kwargs (``domains.<d>.environment.kwargs``):

    Args:
        command_timeout_s: wall clock of one ``run`` command (seconds).
        test_timeout_s: wall clock of the hidden tests at submission (seconds); keep
            ``environment.step_timeout_s`` above it plus a few seconds.
        memory_mb, max_processes, max_disk_mb: the sandbox's limits for a command's whole tree.
        max_output_chars: longest tool result fed back (characters).
        max_calls_per_turn: tool calls of one turn that run (the rest are answered with an error).
        allow_unsafe_sandbox, uid_base, uids_per_rank: as the ``code`` reward's sandbox kwargs.
        reasoning_markers: ``[start, end]`` of a reasoning model (e.g. ``["<think>", "</think>"]``): tool
            calls are read only after a turn's reasoning, and a turn that ends inside it is answered
            with an error (no call runs, the episode goes on); null: the whole turn is read.
    """

    stop_strings = (CLOSE,)
    metric_names = ("tool_calls", "tool_calls_ok", "swe_submitted", "swe_resolved", "swe_files_changed")

    def __init__(self, tokenizer, *, command_timeout_s: float = 10.0, test_timeout_s: float = 60.0,
                 memory_mb: int = 1024, max_processes: int = 8, max_disk_mb: int = 64,
                 max_output_chars: int = 4000, max_calls_per_turn: int = 4, allow_unsafe_sandbox: bool = False,
                 uid_base: int = 61000, uids_per_rank: int = 256,
                 reasoning_markers: Optional[Sequence[str]] = None) -> None:
        super().__init__(tokenizer)
        if reasoning_markers is not None and not (
                len(reasoning_markers) == 2 and all(isinstance(m, str) and m for m in reasoning_markers)
                and reasoning_markers[0] != reasoning_markers[1]):
            raise ValueError(f"environment swe: reasoning_markers must be [start, end] (two different non-empty "
                             f"strings) or null, got {reasoning_markers!r}")
        self.reasoning = ReasoningParser(*reasoning_markers) if reasoning_markers is not None else None
        for name, value in (("command_timeout_s", command_timeout_s), ("test_timeout_s", test_timeout_s)):
            _positive(name, value)
        for name, value in (("memory_mb", memory_mb), ("max_processes", max_processes), ("max_disk_mb", max_disk_mb),
                            ("max_output_chars", max_output_chars), ("max_calls_per_turn", max_calls_per_turn)):
            _positive(name, value, integer=True)
        if not isinstance(allow_unsafe_sandbox, bool):
            raise ValueError("environment swe: allow_unsafe_sandbox must be true or false, "
                             f"got {allow_unsafe_sandbox!r}")
        self.command_timeout_s, self.test_timeout_s = float(command_timeout_s), float(test_timeout_s)
        self.max_output_chars, self.max_calls_per_turn = max_output_chars, max_calls_per_turn
        sandbox = CodeSandbox(allow_unsafe=allow_unsafe_sandbox, uid_base=uid_base, uids_per_rank=uids_per_rank)
        sandbox.resolve_backend()  # refuse now, naming what is missing, rather than in every episode
        self.runner = SandboxRunner(sandbox, memory_mb=memory_mb, max_processes=max_processes, max_disk_mb=max_disk_mb)

    # -- episode ------------------------------------------------------------------------------------
    def start(self, row: dict) -> SWEState:
        """A fresh workspace with a copy of ``row["repo"]`` (the hidden tests stay in the row)."""
        hidden = row.get("hidden_tests")
        if not isinstance(hidden, dict) or not hidden or not all(isinstance(v, str) for v in hidden.values()):
            raise ValueError("a SWE row needs 'hidden_tests': a non-empty object {relative path: file text}")
        for path in hidden:
            normalize_path(path)
        hidden_test_modules(row)
        return SWEState(Workspace.from_repo(row.get("repo"), max_output_chars=self.max_output_chars), row)

    def step(self, state: SWEState, action_ids: Sequence[int], action_text: str) -> EnvStep:
        turn_ended = bool(action_ids) and action_ids[-1] == self.tokenizer.eos_id
        if self.reasoning is not None:  # only calls after the reasoning run (one merely thought about does not)
            parsed = self.reasoning.parse(action_text)
            if not parsed.finished:  # e.g. cut by the </tool_call> stop string while thinking
                note = (f"error: the turn ended inside the reasoning (no {self.reasoning.end}); "
                        "close it before calling tools")
                metrics = dict.fromkeys(self.metric_names, 0.0)
                return EnvStep(tool_turn_ids(self.tokenizer, [note], turn_ended), metrics=metrics)
            action_text = parsed.answer
        calls = parse_tool_calls(action_text)
        results: list[str] = []
        ok = 0
        submitted = not calls
        for i, call in enumerate(calls):
            if isinstance(call, ToolCall) and call.name == "submit":
                submitted = True
                break
            if i >= self.max_calls_per_turn:
                results.append(f"error: at most {self.max_calls_per_turn} tool calls run per turn")
                continue
            text, good = self._call(state, call)
            results.append(text)
            ok += good
        state.tool_calls += min(len(calls), self.max_calls_per_turn)
        metrics = {"tool_calls": float(min(len(calls), self.max_calls_per_turn)), "tool_calls_ok": float(ok),
                   "swe_submitted": 0.0, "swe_resolved": 0.0, "swe_files_changed": 0.0}
        if submitted:
            resolved = self.score(state)
            metrics.update(swe_submitted=1.0, swe_resolved=float(resolved),
                           swe_files_changed=float(len(state.workspace.changed())))
            return EnvStep(done=True, reward=float(resolved), metrics=metrics)
        return EnvStep(tool_turn_ids(self.tokenizer, results, turn_ended), metrics=metrics)

    def finish(self, state: SWEState) -> None:
        """Nothing is on disk (sandboxes remove their own directories); drop the workspace."""
        state.workspace.files = {}

    # -- tools and scoring ----------------------------------------------------------------------------
    def _call(self, state: SWEState, call: ToolCall | BadToolCall) -> tuple[str, bool]:
        """A tool call's result text and whether it succeeded (a misuse is told back, never raised)."""
        if isinstance(call, BadToolCall):
            return f"error: {call.reason}", False
        ws, args = state.workspace, call.arguments
        try:
            if call.name == "view":
                return ws.view(**_only(args, "path", "start_line", "end_line")), True
            if call.name == "search":
                return ws.search(**_only(args, "text", "path")), True
            if call.name == "edit":
                return ws.edit(**_only(args, "path", "old", "new")), True
            if call.name == "run":
                result = self.runner.run_command(ws, **_only(args, "command"), timeout_s=self.command_timeout_s)
                return ws.cut(result.text()), True
            raise ToolError(f"unknown tool {call.name!r}: view, search, edit, run, submit")
        except (ToolError, TypeError) as e:
            return f"error: {e}", False

    def score(self, state: SWEState) -> bool:
        """Run the row's hidden tests on the workspace (in the sandbox): whether all passed."""
        row = state.row
        outcome = self.runner.run_tests(state.workspace, row["hidden_tests"], hidden_test_modules(row),
                                        self.test_timeout_s)
        expected = row.get("hidden_test_count")
        state.resolved = outcome is not None and outcome.passed(expected if isinstance(expected, int) else None)
        return state.resolved


def _only(args: dict, *names: str) -> dict:
    """``args`` limited to the tool's parameters (an unknown one is a TypeError told to the model)."""
    unknown = sorted(set(args) - set(names))
    if unknown:
        raise TypeError(f"unknown argument(s) {unknown}; this tool takes {list(names)}")
    return args
