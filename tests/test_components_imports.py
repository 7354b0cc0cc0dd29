"""Nothing private of components/ is used from outside its own package: no ``_``-prefixed module,
and no ``_``-prefixed name imported from a components module (``from components.data.rollouts import
_x``), by framework/, toolkit/, benchmarks/, launchers/ or another components package (imports read
with ``ast`` at any depth; tests may reach inside). Each rule is also run on a made-up tree where it must
find its violation, so neither can pass by scanning nothing. The cycle checks of components/ live in
tests/test_import_graph.py."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("components", "framework", "toolkit", "tests", "benchmarks", "launchers")  # importers
PRODUCT = ("components", "framework", "toolkit", "benchmarks", "launchers")  # private names: not tests


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The components module ``name`` refers to (itself or its closest parent module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def private_module_imports(root: Path, tops=SCANNED) -> list[str]:
    modules = {_module_name_in(root, p): p for p in (root / "components").rglob("*.py")}
    private = {m for m in modules if m.rpartition(".")[2].startswith("_") and modules[m].name != "__init__.py"}
    bad = []
    for top in tops:
        for path in (root / top).rglob("*.py") if (root / top).is_dir() else ():
            importer_pkg = _package_in(root, path)
            for name, line in _imported_in(root, path):
                t = _target(name, modules)
                if t in private and t.rpartition(".")[0] != importer_pkg:
                    bad.append(f"{path.relative_to(root)}:{line} imports {t}")
    return sorted(set(bad))


def private_name_imports(root: Path, tops=PRODUCT) -> list[str]:
    """``from components.X... import _name`` outside components/X (X: the top package under components)."""
    bad = []
    for top in tops:
        for path in (root / top).rglob("*.py") if (root / top).is_dir() else ():
            importer = _module_name_in(root, path).split(".")
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("components."):
                    continue
                owner = node.module.split(".")[:2]
                if importer[:2] == owner:
                    continue
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{path.relative_to(root)}:{node.lineno} imports {a.name} from {node.module}")
    return sorted(set(bad))


def _module_name_in(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_in(root: Path, path: Path) -> str:
    return ".".join(list(path.relative_to(root).with_suffix("").parts)[:-1])


def _imported_in(root: Path, path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in the file, at any depth; ``from M import a`` yields
    M and M.a (a may be a submodule); relative imports are made absolute."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package_in(root, path).split(".")
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def test_no_private_module_imported_from_outside_its_package():
    assert len(list((ROOT / "components").rglob("*.py"))) > 20  # the scan sees the tree
    bad = private_module_imports(ROOT)
    assert not bad, "private modules imported from outside their package:\n" + "\n".join(bad)


def test_no_private_name_of_a_component_imported_from_outside_its_package():
    bad = private_name_imports(ROOT)
    assert not bad, "private names of components imported from outside their package:\n" + "\n".join(bad)


def test_both_rules_find_a_violation_in_a_made_up_tree(tmp_path):
    (tmp_path / "components" / "data").mkdir(parents=True)
    (tmp_path / "components" / "moe").mkdir(parents=True)
    (tmp_path / "toolkit").mkdir()
    for d in ("components", "components/data", "components/moe", "toolkit"):
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "components" / "data" / "_impl.py").write_text("def helper():\n    return 1\n")
    (tmp_path / "components" / "data" / "rows.py").write_text("from components.data._impl import helper\n\n"
                                                               "def _private():\n    return helper()\n")
    (tmp_path / "components" / "moe" / "replay.py").write_text("from components.data.rows import _private\n")
    (tmp_path / "toolkit" / "tool.py").write_text("from components.data import _impl\n")
    assert private_module_imports(tmp_path) == ["toolkit/tool.py:1 imports components.data._impl"]
    assert private_name_imports(tmp_path) == ["components/moe/replay.py:1 imports _private from components.data.rows",
                                              "toolkit/tool.py:1 imports _impl from components.data"]
