"""The package graph, read from the source: no import circles under refit/, and each layer imports only those below it.

Why: `refit.orchestration` used to be both the driver and everyone's shared
types, so the engine imported the driver to learn the plan, and the plan,
the expected weights and the checkpoint format imported each other in a
circle. Shared types now live in `refit.plan`, which imports only the
building blocks below it (quantizer, provenance, transport), and those
import none of the layers above them. Every import counts
here, also those inside functions and under `TYPE_CHECKING`: a lazy import
is still a dependency. Pure `ast`, no imports of refit itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "refit"

# package -> packages it must never import (at any depth, in any form)
_ABOVE_THE_BLOCKS = ("refit.plan", "refit.orchestration", "refit.engine", "refit.verification", "refit.sharding")
FORBIDDEN = {
    "refit.plan": ("refit.orchestration", "refit.engine"),
    "refit.engine": ("refit.orchestration",),
    "refit.quantizer": _ABOVE_THE_BLOCKS,
    "refit.provenance": _ABOVE_THE_BLOCKS,
    "refit.transport": _ABOVE_THE_BLOCKS,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(refit module imported, line) for every import in the file; `from pkg import mod` counts as `pkg.mod`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "refit"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "refit":
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.append((submodule if submodule in modules else node.module, node.lineno))
    return found


def _graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    lines: dict[tuple[str, str], int] = {}
    for name, path in modules.items():
        for target, line in _imports(path, modules):
            if target != name:
                edges[name].add(target)
                lines.setdefault((name, target), line)
    return edges, lines


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_there_is_no_import_circle_under_refit():
    edges, lines = _graph()
    circle = _cycle(edges)
    assert circle is None, "import circle: " + " -> ".join(
        f"{a} (line {lines[(a, b)]})" for a, b in zip(circle, circle[1:])
    ) + f" -> {circle[-1]}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(package):
    edges, lines = _graph()
    wrong = [f"{module}:{lines[(module, target)]} imports {target}"
             for module, targets in sorted(edges.items()) if _in(module, package)
             for target in sorted(targets) if any(_in(target, above) for above in FORBIDDEN[package])]
    assert not wrong, f"{package} must not import {', '.join(FORBIDDEN[package])}:\n  " + "\n  ".join(wrong)


def test_the_check_sees_a_circle_and_a_forbidden_import():
    """The checker itself: a made-up graph with a circle and an engine module importing the driver."""
    edges = {"refit.a": {"refit.b"}, "refit.b": {"refit.a"}, "refit.engine.x": {"refit.orchestration.syncer"}}
    assert _cycle(edges) == ["refit.a", "refit.b", "refit.a"]
    assert _cycle({"refit.a": {"refit.b"}, "refit.b": set()}) is None
    assert any(_in(t, "refit.orchestration") for t in edges["refit.engine.x"])
