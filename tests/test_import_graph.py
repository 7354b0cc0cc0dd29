"""The import graph of framework/, toolkit/ and components/, read with `ast` from the sources:
every `import` / `from ... import` anywhere in a module (module level and inside functions),
`from framework import x` counted as an import of framework.x when x is a module.

framework (the training path) and toolkit (the tools) have no import cycle; framework never
imports toolkit; components import from framework only its contract, error, device and
compatibility (framework/compat/: the patches of third-party internals) modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPONENT_MAY_IMPORT = {"framework.contracts", "framework.errors", "framework.devices", "framework.compat"}


def _modules(packages) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


ALL = _modules(("framework", "toolkit", "components"))


def _owner(name: str) -> str | None:
    """The module of ours that importing ``name`` loads (a package for one of its attributes)."""
    while name and name not in ALL:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> dict[str, int]:
    """Modules of ours that ``module`` imports anywhere in its body -> first line."""
    path = ALL[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in ALL else base for a in node.names]
        for name in names:
            target = _owner(name)
            if target and target != module:
                out.setdefault(target, node.lineno)
    return out


def graph(prefixes: tuple[str, ...]) -> dict[str, dict[str, int]]:
    mods = [m for m in ALL if m.split(".")[0] in prefixes]
    return {m: {t: ln for t, ln in imports(m).items() if t.split(".")[0] in prefixes} for m in mods}


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle path."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(_path(g, set(comp)))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def _path(g, comp: set[str]) -> list[str]:
    """One cycle through the component's first module: a -> b -> ... -> a (breadth first)."""
    start = min(comp)
    prev, todo = {start: None}, [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(g[v]):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w in comp and w not in prev:
                prev[w] = v
                todo.append(w)
    return sorted(comp)


def _show(g, cyc: list[str]) -> str:
    return " -> ".join(f"{a} (line {g[a][b]})" for a, b in zip(cyc, cyc[1:])) + f" -> {cyc[-1]}"


def test_the_graph_reads_function_level_imports():
    """The reader sees imports inside functions and resolves `from framework import x` to the module."""
    g = graph(("framework", "toolkit"))
    assert "framework.resolve.resolver" in g["toolkit.compare.running"]
    assert "framework.errors" in g["framework.compose.registry"]
    assert "framework.train.build" in g["framework.train.run"]  # imported inside a function of framework.train.run
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {}}) == [["a", "b", "c", "a"]]


def test_framework_and_toolkit_have_no_import_cycle():
    g = graph(("framework", "toolkit"))
    found = cycles(g)
    assert not found, "import cycles:\n" + "\n".join(_show(g, c) for c in found)


def test_framework_never_imports_toolkit():
    g = graph(("framework", "toolkit"))
    bad = [f"{m} imports {t} (line {ln})" for m, ts in g.items() if m.startswith("framework")
           for t, ln in ts.items() if t.startswith("toolkit")]
    assert not bad, "\n".join(bad)


def test_components_import_only_the_contract_modules_of_framework():
    bad = [f"{m} imports {t} (line {ln})" for m in ALL if m.startswith("components")
           for t, ln in imports(m).items()
           if t.startswith("framework") and t not in COMPONENT_MAY_IMPORT | {"framework"}]
    assert not bad, "\n".join(bad)


def test_components_have_no_import_cycle():
    g = graph(("components",))
    # the reader sees module-level edges and those inside functions (an optional dependency's)
    assert "components.moe.chunked_experts" in g["components.moe.chunk"]
    assert "components.losses.lm_head.triton_kernels" in g["components.losses.lm_head.engine"]
    found = cycles(g)
    assert not found, "import cycles:\n" + "\n".join(_show(g, c) for c in found)


def test_components_never_import_toolkit():
    bad = [f"{m} imports {t}" for m in ALL if m.startswith("components") for t in imports(m) if t.startswith("toolkit")]
    assert not bad, "\n".join(bad)


def _local_imports_without_reason(path: Path) -> list[str]:
    """Imports inside a function or class of ``path`` whose last line has no comment; those under a
    module-level ``if`` / ``try`` (``try: import x except ImportError``) count as module level."""
    src = path.read_text()
    lines, tree = src.splitlines(), ast.parse(src, str(path))
    top = {id(n) for n in tree.body}
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            top.update(id(m) for m in ast.walk(n))
    return [f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top
            and "#" not in lines[node.end_lineno - 1]]


def test_function_level_imports_say_why():
    """In framework/, components/ and toolkit/ an import inside a function is for an optional
    dependency, the device-shim order, an import cycle or the CLI's start-up time only, with its
    reason in a comment on the import's last line."""
    bad = [line for p in ALL.values() for line in _local_imports_without_reason(p)]
    assert not bad, "function-level imports without a reason:\n" + "\n".join(bad)


def test_the_reason_check_sees_a_bare_function_level_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    f = tmp_path / "m.py"
    f.write_text("try:\n    import x\nexcept ImportError:\n    x = None\n\n\ndef f():\n    import os\n"
                 "    from json import (\n        dumps,\n    )  # reason: shown\n    import sys  # reason: shown\n")
    assert _local_imports_without_reason(f) == ["m.py:8: import os"]
