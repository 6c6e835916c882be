"""``tool_calling``: episodes in which the model calls the tools its data row declares.

A row declares its tools as JSON schemas (``"tools": [{"name", "description", "parameters"}]``, or
OpenAI's ``{"type": "function", "function": {...}}``). Each model turn is parsed for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks: a turn without one is the final
answer (the episode ends; the domain's reward, e.g. ``tool_calling``, scores the transcript). Each
call is checked against the row's declaration (known name, arguments valid for its ``parameters``
schema) and run; results — or ``error: ...`` for a bad call — go back as one tool-response turn
(:func:`megatron_cascade.environments.chat.tool_turn_ids`).

Metrics per episode: ``tool_calls`` (calls made), ``tool_calls_ok`` (calls that ran without error).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jsonschema

from megatron_cascade.environments.base import EnvStep, Environment, register_environment
from megatron_cascade.environments.chat import tool_turn_ids
from megatron_cascade.rewards.tool_calls import BadToolCall, ToolCall, parse_tool_calls
from megatron_cascade.environments.tools import BUILTIN_TOOLS, PythonTool, ToolFn, load_tool, result_text
from megatron_cascade.rewards.outcome import ResponseFault


def escape_unencodable(text: str) -> str:
    """``text`` with every character outside printable ASCII, newline and tab written as its Python
    escape (``é`` -> ``\\xe9``): what any tokenizer can encode."""
    return "".join(ch if (" " <= ch <= "~") or ch in "\n\t" else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def declared_tools(row: dict) -> dict[str, dict]:
    """``{name: parameters schema}`` of the row's ``tools`` (ValueError naming the problem)."""
    tools = row.get("tools")
    if not isinstance(tools, list) or not tools:
        raise ValueError("a tool_calling row needs a non-empty 'tools' list of JSON schemas")
    out = {}
    for tool in tools:
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"tool declaration {tool!r} has no 'name'")
        params = spec.get("parameters", {"type": "object"})
        jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator).check_schema(params)
        out[spec["name"]] = params
    return out


def _check_known(name: str, mapped: Mapping[str, Any]) -> None:
    if name not in mapped and name not in BUILTIN_TOOLS:
        raise ValueError(f"the row declares tool {name!r}, which environment.kwargs.tools does not map "
                         f"and is not a built-in ({', '.join(BUILTIN_TOOLS)})")


@register_environment("tool_calling")
class ToolCallingEnvironment(Environment):
    """Tools declared per row, implemented by name.

    Args (``environment.kwargs``):
        tools: tool name -> implementation (``calculator``, ``python`` or ``pkg.module:function``);
            a declared tool not listed here uses the built-in of the same name.
        python_timeout_s: wall-clock limit of one ``python`` tool program (sandbox-enforced).
        allow_unsafe_sandbox: where the isolated sandbox cannot run, run ``python`` programs with
            rlimits only (as the code reward's kwarg of the same name).
        max_result_chars: a tool result longer than this is cut (it costs episode tokens).
    """

    metric_names = ("tool_calls", "tool_calls_ok")

    def __init__(self, tokenizer, *, tools: Optional[Mapping[str, str]] = None, python_timeout_s: float = 5.0,
                 allow_unsafe_sandbox: bool = False, max_result_chars: int = 1000) -> None:
        super().__init__(tokenizer)
        if max_result_chars < 1:
            raise ValueError(f"max_result_chars={max_result_chars} must be >= 1")
        self.options = {"python_timeout_s": python_timeout_s, "allow_unsafe_sandbox": allow_unsafe_sandbox}
        self.max_result_chars = max_result_chars
        self.impls: dict[str, ToolFn] = {name: load_tool(spec, **self.options) for name, spec in (tools or {}).items()}
        for impl in self.impls.values():
            if isinstance(impl, PythonTool):
                impl.preflight()

    @classmethod
    def check_row(cls, row: dict, kwargs: Mapping[str, Any]) -> None:
        """The row declares valid tool schemas, each the config's (``kwargs["tools"]``) or a built-in."""
        mapped = kwargs.get("tools") or {}
        for name in declared_tools(row):
            _check_known(name, mapped)

    def _impl(self, name: str) -> ToolFn:
        """The implementation of a tool a row declares: the config's, else the built-in of that name.
        A row is data: a name it declares never imports code (``os:system`` is refused; rows are
        checked when the data loads, and again here)."""
        if name not in self.impls:
            _check_known(name, self.impls)
            self.impls[name] = load_tool(name, **self.options)
        return self.impls[name]

    def start(self, row: dict) -> dict[str, tuple[dict, ToolFn]]:
        """The row's tools: name -> (parameters schema, implementation)."""
        return {name: (params, self._impl(name)) for name, params in declared_tools(row).items()}

    def step(self, state: dict[str, tuple[dict, Any]], action_ids: Sequence[int], action_text: str) -> EnvStep:
        calls = parse_tool_calls(action_text)
        if not calls:
            return EnvStep(done=True)
        results = [self._run(state, call) for call in calls]
        ok = sum(1 for r in results if not r.startswith("error:"))
        turn_ended = bool(action_ids) and action_ids[-1] == self.tokenizer.eos_id
        return EnvStep(observation_ids=self._observation_ids(results, turn_ended),
                       metrics={"tool_calls": float(len(calls)), "tool_calls_ok": float(ok)})

    def _observation_ids(self, results: list[str], turn_ended: bool) -> list[int]:
        """The tool turn's tokens. Results echo what the model wrote (a tool name, a program's
        output): where the tokenizer cannot encode a character of theirs (a character vocabulary),
        they go back with such characters escaped (``\\xe9``), so that the turn costs the episode
        nothing it could use to escape its reward; if even that fails, the turn is at fault."""
        try:
            return tool_turn_ids(self.tokenizer, results, turn_ended)
        except ValueError:
            escaped = [escape_unencodable(r) for r in results]
            if escaped == results:
                raise  # not a character problem: the template's (an error of the environment)
        try:
            return tool_turn_ids(self.tokenizer, escaped, turn_ended)
        except ValueError as e:
            raise ResponseFault(f"the tool results of this turn cannot be tokenized: {e}") from None

    def _run(self, state: dict[str, tuple[dict, Any]], call: ToolCall | BadToolCall) -> str:
        if isinstance(call, BadToolCall):
            return f"error: {call.reason}"
        if call.name not in state:
            return f"error: unknown tool {call.name!r}; available: {sorted(state)}"
        params, impl = state[call.name]
        problem = jsonschema.exceptions.best_match(
            jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator)(params)
            .iter_errors(call.arguments))
        if problem is not None:
            return f"error: invalid arguments for {call.name}: {problem.message}"
        try:
            return result_text(impl(**call.arguments), self.max_result_chars)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation, not a crash
            return f"error: {type(exc).__name__}: {exc}"
