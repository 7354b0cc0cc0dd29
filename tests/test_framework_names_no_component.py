"""framework/ names no component: no registry name in its strings (messages, keys, comparisons) or
identifiers, and no component module. It reaches components only through framework.registry and
the members of framework/contracts.py. (The planner's own, stricter check, which also covers the
options the planner must not read: tests/test_planner_terms.py.)"""

from __future__ import annotations

import ast
import re

from test_planner_terms import ENGLISH, _names, _strings, identifiers_naming

from conftest import ROOT

# the planner's calibration table: constants users calibrate by name (calib.zero1_param_bytes); the
# components read them in their plan_terms (tests/test_planner_terms.py says why it is exempt)
CALIBRATION = {ROOT / "framework" / "planner" / "constants.py"}
# also words of the framework's own vocabulary: `fp8` is one of apiary compare's tolerance kinds
# (contracts.Tolerance, --tol=fp8); `none` a value of parallel.cp_load_balancer
VOCABULARY = ENGLISH | {"fp8"}


def _files():
    files = sorted(p for p in (ROOT / "framework").rglob("*.py") if p not in CALIBRATION)
    assert len(files) > 20
    return files


def test_framework_strings_and_identifiers_name_no_component():
    names = set().union(*_names().values())
    words = names - VOCABULARY
    found = []
    for path in _files():
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT)
        for node, text, _ in _strings(tree):
            if text in words:
                found.append(f"{rel}:{node.lineno} {text!r}")
            for w in words:
                if text not in names and re.search(rf"(?<![\w.]){re.escape(w)}(?![\w])", text):
                    found.append(f"{rel}:{node.lineno} {text[:70]!r} names {w!r}")
        found += [f"{rel}:{line} identifier {ident}" for line, ident in identifiers_naming(tree, words)]
    assert not found, "\n".join(found)


def test_framework_imports_no_component_module():
    found = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {m}" for m in mods
                      if m == "components" or m.startswith("components.")]
        named = re.findall(r"(?<![\w.])components\.\w+\.\w+", path.read_text())  # not torchtitan.components.*
        found += [f"{path.relative_to(ROOT)}: names {m}" for m in named]
    assert not found, "\n".join(found)
