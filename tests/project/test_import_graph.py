"""The shape of reg's own code: no import cycle, function-level and type-only imports included
(a cycle through `if TYPE_CHECKING:` is still a knot a reader has to untie); every package of
`registry/` in exactly one layer of [tool.importlinter] (`lint-imports`, run by scripts/test,
checks the layers themselves); few modules at the root; none over 600 lines; and imports inside
functions only where they defer something, saying what."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    # Importing a.b.c runs a/b/__init__.py first: an edge to every package on the way that is
    # not one of the importer's own (those ran before it did). The top packages' own __init__
    # (registry's public API) are left out: policies/ reaching registry.errors through it is the
    # one import the policies contract allows.
    for name in list(out):
        parts = name.split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            if package in known and not module.startswith(package + ".") and package != module:
                out.add(package)
    return out


def import_graph(*, type_only: bool = True) -> dict[str, set[str]]:
    """Each module's imports of our modules; `type_only=False` leaves out those under
    `if TYPE_CHECKING:` (the graph of what runs)."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = set() if type_only else _type_checking_only(tree)
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
    # importing a submodule runs its package's __init__ first: an edge the walker counts
    tree = ast.parse("from registry.lifecycle.promotion.hf import release_hf\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    known = {
        *("registry", "registry.lifecycle", "registry.lifecycle.releases"),
        *("registry.lifecycle.promotion", "registry.lifecycle.promotion.hf"),
    }
    path = ROOT / "registry/lifecycle/releases.py"
    assert _imported("registry.lifecycle.releases", path, node, known) == {
        "registry.lifecycle.promotion",
        "registry.lifecycle.promotion.hf",
    }


def test_reg_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 150  # every module was read
    assert "registry.lifecycle.verify" in graph["registry.lifecycle.checkpoints.read"]  # in a def
    # under TYPE_CHECKING only: counted all the same
    assert "registry.lifecycle.context" in graph["registry.lifecycle.verify"]
    assert (
        "registry.lifecycle.context"
        not in import_graph(type_only=False)["registry.lifecycle.verify"]
    )
    assert cycles(graph) == []


# -- the tree is the layer diagram --------------------------------------------------------------

MAX_ROOT_MODULES = 6
MAX_LINES = 600


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["importlinter"]["contracts"])


def _layered(contract: dict[str, object]) -> list[str]:
    """Every name in a layers contract, each layer's `a | b` and `a : b` split."""
    names: list[str] = []
    for layer in contract["layers"]:  # type: ignore[attr-defined]
        names += [n.strip() for n in layer.replace(":", "|").split("|")]
    return names


def unlayered(children: list[str], named: list[str]) -> list[str]:
    """The children a layers contract does not name, and those it names more than once."""
    return sorted({c for c in children if named.count(c) != 1})


def _children(package: Path, prefix: str) -> list[str]:
    """A package's modules and subpackages, dotted, its __init__ left out."""
    found = []
    for path in sorted(package.iterdir()):
        if path.name == "__pycache__" or path.name.startswith("."):
            continue
        if path.is_dir() and (path / "__init__.py").exists():
            found.append(f"{prefix}.{path.name}")
        elif path.suffix == ".py" and path.name != "__init__.py":
            found.append(f"{prefix}.{path.stem}")
    return found


def test_every_package_is_in_exactly_one_layer():
    """A new package or module of registry/ (or of registry/api/) fails here until the
    import-linter contract names it in one layer, which says what it may import."""
    contracts = _contracts()
    top = next(c for c in contracts if "cli" in c.get("layers", []))  # type: ignore[operator]
    assert unlayered(_children(ROOT / "registry", "registry"), _layered(top)) == []
    api = next(c for c in contracts if c.get("containers") == ["registry.api"])
    named = [f"registry.api.{n}" for n in _layered(api)]
    assert unlayered(_children(ROOT / "registry" / "api", "registry.api"), named) == []


def test_the_layer_rule_sees_a_module_in_no_layer_and_one_in_two():
    named = ["registry.a", "registry.b", "registry.b"]
    assert unlayered(["registry.a", "registry.b", "registry.c"], named) == [
        "registry.b",
        "registry.c",
    ]


def test_the_cli_may_import_no_internals():
    """The CLI talks to the public API: a contract forbids it the packages under the API."""
    forbidden = next(c for c in _contracts() if c.get("source_modules") == ["cli"])
    assert set(forbidden["forbidden_modules"]) >= {  # type: ignore[arg-type]
        *("registry.lifecycle", "registry.operations", "registry.catalog", "registry.storage"),
        *("registry.formats", "registry.journal", "registry.trust"),
    }


def test_few_modules_at_the_root_of_registry():
    loose = [p.name for p in (ROOT / "registry").glob("*.py")]
    assert len(loose) <= MAX_ROOT_MODULES, sorted(loose)


def test_no_module_is_over_600_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


# -- function-level imports: only where start-up time needs them -----------------------------------

# Third-party packages that cost a command's start-up (each 0.1-3 s to import on our machines).
HEAVY = frozenset(
    {
        *("torch", "numpy", "safetensors", "transformers", "mlflow", "flask", "werkzeug"),
        *("boto3", "botocore", "s3transfer", "httpx", "fastapi", "starlette", "uvicorn"),
        *("sqlalchemy", "sqlmodel", "alembic", "psycopg", "pydantic", "jwt", "cryptography"),
        *("prometheus_client", "matplotlib", "typer", "yaml", "model_signing"),
    }
)
# Lazy by design, each as its docstring says: a command imports them and pays only for what it
# touches (the CLI, the registry objects).
ENTRY = (
    "cli",
    "registry",
    "registry.api.contract",
    "registry.api.local",
    "registry.api.local_admin",
    "registry.api.remote.registry",
)


def _loads(node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """What an import statement runs: our modules with their packages, and third-party tops."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = set()
    for name in names:
        parts = name.split(".")
        if parts[0] not in PACKAGES:
            out.add(parts[0])
            continue
        out.update(p for i in range(len(parts)) if (p := ".".join(parts[: i + 1])) in known)
    return out


def _module_level(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    skip = _type_checking_only(tree)
    return [
        n
        for stmt in tree.body
        if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for n in ast.walk(stmt)
        if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skip
    ]


def heavy_modules(trees: dict[str, ast.Module]) -> set[str]:
    """Our modules whose import loads a HEAVY package, at their top or through another."""
    known = set(trees)
    loads = {
        m: set().union(set(), *(_loads(n, known) for n in _module_level(t)))
        for m, t in trees.items()
    }
    heavy = {m for m, found in loads.items() if found & HEAVY}
    grew = True
    while grew:
        before = len(heavy)
        heavy |= {m for m, found in loads.items() if found & heavy}
        grew = len(heavy) > before
    return heavy


def deferred_without_reason() -> list[str]:
    """Function-level imports outside ENTRY that load nothing heavy and say no reason."""
    modules = _modules()
    trees = {m: ast.parse(p.read_text()) for m, p in modules.items()}
    heavy = heavy_modules(trees) | HEAVY
    found = []
    for module, tree in trees.items():
        if module in ENTRY or module.startswith("cli.") or ".migrations." in module:
            continue
        lines = modules[module].read_text().splitlines()
        skip = _type_checking_only(tree)
        top = {id(n) for n in _module_level(tree)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in skip | top:
                continue
            if _loads(node, set(trees)) & heavy:
                continue
            said = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
            if "#" not in said:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_a_function_level_import_is_there_for_start_up_time():
    """An import sits in a function only where importing it at the top would cost start-up
    (it loads torch, SQLAlchemy, boto3, MLflow... or a module of ours that does), in the entry
    modules that are lazy by design, or with a comment saying why; else at the top, where a
    reader sees what a module depends on."""
    assert deferred_without_reason() == []
    trees = {m: ast.parse(p.read_text()) for m, p in _modules().items()}
    heavy = heavy_modules(trees)
    assert "registry.catalog.models" in heavy and "registry.formats.dcp_torch" in heavy
    assert "registry.errors" not in heavy and "registry.core.refs" not in heavy


def test_the_rule_sees_a_light_import_deferred_for_no_reason(tmp_path):
    tree = ast.parse("def f():\n    from registry import errors\n    import torch\n")
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    known = {"registry", "registry.errors"}
    assert [_loads(n, known) for n in imports] == [{"registry", "registry.errors"}, {"torch"}]
    assert heavy_modules({"a": ast.parse("import torch"), "b": ast.parse("import a")}) >= {"a", "b"}
