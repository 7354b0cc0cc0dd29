"""No ``_``-prefixed module of components/ is imported from outside its own package (imports read
with ``ast`` at any depth). The cycle checks of components/ live in tests/test_import_graph.py."""

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
