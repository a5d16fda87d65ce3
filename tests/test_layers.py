"""The package's layers (docs/architecture.md, "The layers"): every import inside ``lightning_sync`` goes down or
sideways, never up, and no modules import each other in a circle. Read from the source with ``ast`` (no import, so
it costs well under a second): module-level imports, imports inside functions, and imports under
``if TYPE_CHECKING:`` all count: a circle that only type checkers see is still two modules that cannot be read
(or split) one without the other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_sync"

#: the layer of each part of the package, lowest first: a module may import its own layer and those below it.
#: ``models`` and ``data`` hold LightningModules and DataModules built on ``core`` alone; ``launch`` and ``cluster``
#: start processes (for the harness and the tests); ``trainer_cli`` is the Trainer entry point that ``lightning-sync
#: fit`` and the harness's workers run; ``cli`` dispatches to everything.
LAYERS: dict[str, int] = {
    "core": 0,
    "comm": 1,
    "data": 2,
    "models": 2,
    "strategies": 3,
    "callbacks": 4,
    "": 5,  # lightning_sync/__init__.py: the strategies and callbacks, registered
    "launch": 5,
    "cluster": 5,
    "trainer_cli": 6,
    "benchmark": 7,
    "compare": 8,
    "search": 8,
    "demo": 8,
    "cli": 9,
}

#: import edges (importer, imported) allowed although they close a circle; each is a known defect to remove, and
#: the test fails once one is gone so the list only shrinks.
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING":
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


def import_graph() -> dict[str, dict[str, str]]:
    """``{module: {imported module: how}}`` over the package's modules; ``how`` is ``"module"`` (at import time),
    ``"function"`` (inside a function or class body that runs later) or ``"type-checking"``. ``from a import b`` is
    an edge to ``a.b`` where that is a module, else to ``a``; an edge to a module's parent package that Python
    imports on the way is not counted (every module would import its own package)."""
    modules = _modules()
    graph: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        top = {id(n) for n in tree.body}
        edges = graph.setdefault(name, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if not target.startswith("lightning_sync") or target == name:
                    continue
                how = "type-checking" if id(node) in typing_only else "module" if id(node) in top else "function"
                if edges.get(target) != "module":
                    edges[target] = how
    return graph


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    assert part in LAYERS, f"{module}: no layer for {part!r}; add it to LAYERS (and to docs/architecture.md)"
    return LAYERS[part]


def _circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_parser_sees_the_imports_it_must():
    """So that the two tests below cannot pass on a graph that lost its edges."""
    graph = import_graph()
    assert graph["lightning_sync.cli"]["lightning_sync.trainer_cli"] == "module"
    assert graph["lightning_sync.cli"]["lightning_sync.compare"] == "function"
    assert (
        graph["lightning_sync.strategies.ft_topology"]["lightning_sync.strategies.fault_tolerance"] == "type-checking"
    )
    assert graph["lightning_sync.comm.ft.mirror"]["lightning_sync.comm.ft.replica_group"] == "module"
    assert "lightning_sync.benchmark.plots" in graph["lightning_sync.benchmark.merge"]


def test_no_import_goes_up_a_layer():
    graph = import_graph()
    upward = [
        f"{module} ({_layer(module)}) imports {target} ({_layer(target)}) [{how}]"
        for module, edges in graph.items()
        for target, how in edges.items()
        if _layer(target) > _layer(module)
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_circle_but_the_known_ones():
    graph = import_graph()
    present = {(m, t) for m, edges in graph.items() for t in edges}
    stale = KNOWN_CIRCLE_EDGES - present
    assert not stale, f"known circle edges no longer there: remove them from KNOWN_CIRCLE_EDGES: {sorted(stale)}"
    pruned = {m: {t: how for t, how in edges.items() if (m, t) not in KNOWN_CIRCLE_EDGES} for m, edges in graph.items()}
    circles = _circles(pruned)
    described = [
        " <-> ".join(c) + ": " + ", ".join(f"{a} -> {b} [{graph[a][b]}]" for a in c for b in graph[a] if b in c)
        for c in circles
    ]
    assert not circles, "import circles:\n" + "\n".join(described)
    # each known edge still closes a circle (else it is no longer a defect: drop it from the list)
    closing = {edge for c in _circles(graph) for edge in KNOWN_CIRCLE_EDGES if edge[0] in c and edge[1] in c}
    assert closing == KNOWN_CIRCLE_EDGES, f"known edges that close no circle: {sorted(KNOWN_CIRCLE_EDGES - closing)}"
