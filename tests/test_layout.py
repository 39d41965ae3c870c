"""The package's import graph has no cycle: each module can be read after the ones it imports."""

from __future__ import annotations

import ast
from pathlib import Path

import grpo

PACKAGE = Path(grpo.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The grpo modules `path` imports, at the top or inside functions (a package's own __init__ is not counted
    for its submodules: Python runs it first anyway)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    own = module_name(path)
    return {m for m in found if m != own and not own.startswith(m + ".")}


def test_no_import_cycles():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: imports(p, set(paths)) for m, p in paths.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
