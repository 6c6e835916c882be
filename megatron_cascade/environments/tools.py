"""Tool implementations the ``tool_calling`` environment runs: ``calculator`` (arithmetic, no eval),
``python`` (a program in the code sandbox, its stdout the result) and user tools ``pkg.module:function``
(called with the call's arguments as keyword arguments; a non-string result is sent back as JSON).
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import operator
from typing import Any, Callable

from megatron_cascade.rewards.sandbox import CodeSandbox, Program, SandboxLimits

ToolFn = Callable[..., Any]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_MAGNITUDE = 1e15  # operands and results; keeps 9**9**9 and friends from running for minutes


def calculator(expression: str) -> str:
    """The value of an arithmetic ``expression`` (numbers, + - * / // % **, parentheses).

    Raises:
        ValueError: anything else (names, calls, ...), division by zero, or a magnitude over 1e15.
    """
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("expression must be a string of at most 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".10g")


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large (at most 64)")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    raise ValueError(f"unsupported element {type(node).__name__} (numbers and + - * / // % ** only)")


def _bounded(value: Any) -> float | int:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > _MAX_MAGNITUDE:
        raise ValueError("result out of range (|x| <= 1e15)")
    return value


class PythonTool:
    """``python(code)``: runs ``code`` in the code sandbox (same isolation as the code reward) and
    returns its stdout, or its exit status and the tail of stderr when it failed."""

    def __init__(self, timeout_s: float = 5.0, allow_unsafe: bool = False) -> None:
        self.sandbox = CodeSandbox(allow_unsafe=allow_unsafe)
        self.limits = SandboxLimits(timeout_s=timeout_s)

    def preflight(self) -> None:
        """Refuse now (naming what is missing) when the sandbox cannot run here."""
        self.sandbox.resolve_backend()

    def __call__(self, code: str) -> str:
        if not isinstance(code, str):
            raise ValueError("code must be a string")
        result = self.sandbox.run(Program(code), self.limits)
        if result.timed_out:
            return f"error: timed out after {self.limits.timeout_s} s"
        if result.returncode != 0:
            return f"error: exit status {result.returncode}\n{result.stderr[-500:]}"
        return result.stdout


BUILTIN_TOOLS = ("calculator", "python")


def load_tool(spec: str, *, python_timeout_s: float = 5.0, allow_unsafe_sandbox: bool = False) -> ToolFn:
    """The implementation named ``spec``: ``calculator``, ``python``, or ``pkg.module:function``
    (imported: only for names the config gives, never for a data row's)."""
    if spec == "calculator":
        return calculator
    if spec == "python":
        return PythonTool(python_timeout_s, allow_unsafe_sandbox)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise KeyError(f"unknown tool implementation {spec!r}: 'calculator', 'python' or 'pkg.module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"tool {spec!r} is not callable")
    return obj


def result_text(value: Any, max_chars: int) -> str:
    """A tool's return value as the text fed back (JSON unless a string), cut to ``max_chars``."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= max_chars else text[:max_chars] + "...[truncated]"
