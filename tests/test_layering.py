"""The package's layers, read from its own imports (``docs/architecture.md`` says what each layer is).

Each package (or top-level module) of ``megatron_cascade`` sits in one layer; it may import only
packages of lower layers (and itself). Every import counts — at module level, inside functions,
and under ``TYPE_CHECKING``: what a reader must understand first is what the code names, whether or
not Python loads it at import time. No two modules import each other, directly or in a ring.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_cascade"

# Bottom to top. A new package goes where its imports put it (and docs/architecture.md says why).
LAYERS: list[tuple[str, ...]] = [
    ("config",),  # the run's schema, its validation and declarative registries: imports nothing of ours
    ("ops", "algorithms", "checkpoint_safety", "tokenizers", "rewards", "run_logging",
     "models"),  # pure math, parsers, verifiers; each HF model family's mapping
    ("model",),  # Megatron-Core models, layouts, weight checkpoints
    ("torch_kernels",),  # torch stand-ins for CUDA-extension kernels
    ("cpu_runtime",),  # Megatron-Core on CPU
    ("convert", "rollout"),  # HF <-> Megatron; generation
    ("environments", "training"),  # episodes; the training step, the policy, the decode copy
    ("stages",),  # the per-type part of a stage and the RL step's pieces
    ("cascade", "doctor"),  # the orchestrator; environment checks
    ("cli", "testing"),  # entry points; test helpers
]
LAYER_OF = {name: index for index, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[tuple[str, int]]:
    """(module, line) of every ``megatron_cascade`` module ``path`` imports, wherever the import is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_cascade"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add((sub if sub in MODULES else node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found.update((alias.name, node.lineno) for alias in node.names if alias.name.startswith("megatron_cascade"))
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def test_every_package_has_a_layer():
    packages = {_package(m) for m in MODULES} - {"(root)"}
    assert packages <= set(LAYER_OF), f"place these in LAYERS (and docs/architecture.md): {sorted(packages - set(LAYER_OF))}"
    assert set(LAYER_OF) <= packages, f"LAYERS names what no longer exists: {sorted(set(LAYER_OF) - packages)}"


def test_no_import_against_the_layers():
    wrong = []
    for module, path in MODULES.items():
        source = _package(module)
        if source == "(root)":
            continue
        for target, line in _imports(path):
            to = _package(target)
            if to in ("(root)", source):
                continue
            if LAYER_OF[to] >= LAYER_OF[source]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {source} (layer {LAYER_OF[source]}) "
                             f"imports {target} ({to}, layer {LAYER_OF[to]})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_modules_import_each_other():
    graph = {m: {t for t, _ in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # A package's __init__ re-exports its modules: an import of the package is not a ring through them.
    for module in graph:
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    rings = _strongly_connected(graph)
    assert not rings, "modules importing each other: " + "; ".join(" <-> ".join(sorted(r)) for r in rings)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    rings: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                ring.add(w)
                if w == v:
                    break
            if len(ring) > 1:
                rings.append(ring)

    for v in graph:
        if v not in index:
            visit(v)
    return rings


@pytest.mark.parametrize("limit", [450])
def test_no_module_over_the_line_limit(limit):
    over = {str(p.relative_to(PACKAGE.parent)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > limit}
    assert not over, f"modules over {limit} lines (split them along their seams): {over}"


def _own_lines(node: ast.AST) -> int:
    """Lines of a function's body without its docstring and without the functions and classes defined
    inside it (each of those is measured on its own)."""
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body:
        return 0
    lines = set(range(body[0].lineno, node.end_lineno + 1))
    for inner in ast.walk(node):
        if inner is not node and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([d.lineno for d in inner.decorator_list] + [inner.lineno])
            lines -= set(range(first, inner.end_lineno + 1))
    return len(lines)


def test_no_function_over_80_lines():
    over = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n := _own_lines(node)) > 80:
                over.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.name} ({n} lines)")
    assert not over, "functions over 80 lines (docstring excluded):\n" + "\n".join(over)
