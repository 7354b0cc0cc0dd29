"""The import graph of components/, read with ``ast`` (module-level and function-level imports
alike): no cycle, and no ``_``-prefixed module imported from outside its own package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("components", "framework", "toolkit", "tests", "benchmarks", "launchers")  # importers


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1])


def _imported(path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in the file, at any depth; ``from M import a`` yields
    M and M.a (a may be a submodule); relative imports are made absolute."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package_of(path).split(".")
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def _components() -> dict[str, Path]:
    return {_module_name(p): p for p in (ROOT / "components").rglob("*.py")}


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The components module ``name`` refers to (itself or its closest parent module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, dict[str, int]]:
    modules = _components()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for m, path in modules.items():
        for name, line in _imported(path):
            t = _target(name, modules)
            if t and t != m:
                graph[m].setdefault(t, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_graph_sees_function_level_imports():
    """The reader counts imports inside functions (a cycle held together by one would show)."""
    graph = _graph()
    # components.moe.chunk imports chunked_experts at module level; losses.lm_head.engine imports
    # its Triton kernels inside functions (optional dependency): both edges must be present.
    assert "components.moe.chunked_experts" in graph["components.moe.chunk"]
    assert "components.losses.lm_head.triton_kernels" in graph["components.losses.lm_head.engine"]


def test_no_import_cycle_in_components():
    graph = _graph()
    cycles = _cycles(graph)
    detail = ["  " + " <-> ".join(c) + ": " + "; ".join(
        f"{a} -> {b} (line {graph[a][b]})" for a in c for b in graph[a] if b in c) for c in cycles]
    assert not cycles, "import cycles in components/:\n" + "\n".join(detail)


def test_no_private_module_imported_from_outside_its_package():
    modules = _components()
    private = {m for m in modules if m.rpartition(".")[2].startswith("_") and not m.endswith("__init__")
               and modules[m].name != "__init__.py"}
    bad = []
    for top in SCANNED:
        for path in (ROOT / top).rglob("*.py") if (ROOT / top).is_dir() else ():
            importer_pkg = _package_of(path)
            for name, line in _imported(path):
                t = _target(name, modules)
                if t in private and t.rpartition(".")[0] != importer_pkg:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {t}")
    assert not bad, "private modules imported from outside their package:\n" + "\n".join(sorted(set(bad)))


def test_cycle_finder_reports_a_cycle():
    toy = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _cycles(toy) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []
