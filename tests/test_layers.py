"""The structure as a contract: kvreplay's packages import only downward (the layers written once
in pyproject.toml's [tool.importlinter], drawn in docs/architecture.md), no two modules import
each other through any chain, and no Python module grows past 400 lines."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400


def test_packages_import_only_downward():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), imports inside functions
    included."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return groups


def test_no_import_circles():
    graph = grimp.build_graph("kvreplay")
    # a package's __init__ that re-exports its own modules is not a circle of responsibilities
    for package in ("kvreplay", "kvreplay.kv"):
        for imported in list(graph.find_modules_directly_imported_by(package)):
            graph.remove_import(importer=package, imported=imported)
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_circle():
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    assert _cycles(graph) == []
    graph.add_import(importer="c", imported="a")
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_python_module_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for path in sorted((ROOT / "kvreplay").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
