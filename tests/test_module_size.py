"""The serving path stays readable: no module there over ``MAX_MODULE_LINES`` lines and
no function over ``MAX_FUNCTION_LINES`` (the worker, router, gateway, kvindex, the bus,
the data plane and the engines: docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVING_PATH = ("services", "libs/cpd/bus", "libs/cpd/transfer", "libs/cpd/engines")
MAX_MODULE_LINES = 420
MAX_FUNCTION_LINES = 60


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function or method of ``source`` longer than ``limit``
    lines (decorators excluded, docstring included)."""
    return [(node.name, node.end_lineno - node.lineno + 1)  # type: ignore[operator]
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > limit]  # type: ignore[operator]


def _modules() -> list[Path]:
    return sorted(p for d in SERVING_PATH for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("body_lines, flagged", [(3, False), (60, False), (61, True)])
def test_the_rule_measures_functions(body_lines: int, flagged: bool) -> None:
    source = ("def f():\n" + "    x = 1\n" * (body_lines - 1)
              + "\n\nclass C:\n    def g(self): ...\n")
    assert bool(long_functions(source)) is flagged


def test_no_serving_module_or_function_is_too_long() -> None:
    modules = _modules()
    assert len(modules) > 40  # the walk found the serving path
    too_long = {str(p.relative_to(ROOT)): n for p in modules
                if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"
    functions = {f"{p.relative_to(ROOT)}:{name}": n for p in modules
                 for name, n in long_functions(p.read_text())}
    assert not functions, f"functions over {MAX_FUNCTION_LINES} lines: {functions}"
