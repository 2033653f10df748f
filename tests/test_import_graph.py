"""No import cycle in reg's own code, function-level imports included (those only under
`if TYPE_CHECKING:` never run and are not counted). `lint-imports` (scripts/test) checks the
layers of [tool.importlinter]; this walks every import statement, wherever it sits."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("registry", "policies", "cli")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imported(
    module: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]
) -> set[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")[: None if path.name == "__init__.py" else -1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        graph[module] = set().union(
            *(
                _imported(module, path, node, known)
                for node in ast.walk(tree)
                if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip
            )
        )
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_a_cycle_made_by_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from registry import errors\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    known = {"registry", "registry.errors", "registry.text"}
    assert _imported("registry.text", ROOT / "registry/text.py", node, known) == {"registry.errors"}


def test_reg_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 150  # every module was read
    assert "registry.lifecycle.verify" in graph["registry.lifecycle.checkpoints.read"]  # in a def
    assert cycles(graph) == []
