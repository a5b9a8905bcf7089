"""nanscan's modules import one another in one direction only: entry points -> layouts -> the fused
scan -> the ops (DESIGN.md section 2). A circle, even one hidden behind ``TYPE_CHECKING`` or inside a
function, means two modules that cannot be read (or changed) one without the other."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "nanscan"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Every nanscan module and the nanscan modules it imports, wherever the import statement is. An
    import of a module's own package (``from . import x`` in a package's module) is how Python finds
    the sibling, not a use of the package's body, and is no edge."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target in paths and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    assert "nanscan.layouts.fsdp1" in graph and "nanscan.fused" in graph["nanscan.layouts"]  # the walk sees imports
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
