"""framework/ names no component and no layer kind: no registry name in its strings (messages, keys,
comparisons) or identifiers, no layer kind of a model family, and no component module. It reaches
components only through framework.compose.registry and the members of framework/contracts/. (The
planner's own, stricter check, which also covers the options the planner must not read:
tests/test_planner_terms.py.)"""

from __future__ import annotations

import ast
import re

from test_planner_terms import ENGLISH, _names, _strings, identifiers_naming

from conftest import ROOT

# also words of the framework's own vocabulary: `fp8` is one of apiary compare's tolerance kinds
# (contracts.Tolerance, --tol=fp8); `none` a value of parallel.cp_load_balancer
VOCABULARY = ENGLISH | {"fp8"}
# the model families' layer kinds (components/models/layer_kinds.py) and the words that name them:
# the planner counts them through ModelFacts.layer_kinds, never by name. Checked in any case in
# strings ("GatedDeltaNet"), and as whole _-separated parts of identifiers.
LAYER_KINDS = {"linear_attention", "linear_attn", "gated", "deltanet", "gateddeltanet", "gated_deltanet", "gdn",
               "mlp"}


def _files():
    files = sorted((ROOT / "framework").rglob("*.py"))
    assert len(files) > 20
    return files


def layer_kind_mentions(path, tree) -> list[str]:
    """Where a framework file names a layer kind: in a string (any case), or as a part of an
    identifier (``gdn_chunk``, ``eff_mlp``)."""
    rel = path.relative_to(ROOT)
    found = []
    for node, text, _ in _strings(tree):
        for w in LAYER_KINDS:
            if re.search(rf"(?<![\w.]){re.escape(w)}(?![\w])", text, re.IGNORECASE):
                found.append(f"{rel}:{node.lineno} {text[:70]!r} names the layer kind {w!r}")
    found += [f"{rel}:{line} identifier {ident}" for line, ident in identifiers_naming(tree, LAYER_KINDS)]
    return found


def test_framework_names_no_layer_kind():
    found = []
    for path in _files():
        found += layer_kind_mentions(path, ast.parse(path.read_text()))
    assert not found, "\n".join(found)


def test_the_layer_kind_check_catches_what_the_planner_used_to_say():
    """The planner's former constants and FLOPs read as the check sees them."""
    old = ast.parse('''
class Constants:
    gdn_chunk: int = _c(64, "GatedDeltaNet chunk length of fla's chunked kernels")
    selective_keep: dict = _c({"attention": 0.1, "linear_attention": 0.1, "moe": 0.1, "mlp": 0.1}, "")
''')
    found = layer_kind_mentions(ROOT / "framework" / "plan" / "planner" / "constants.py", old)
    assert any("identifier gdn_chunk" in x for x in found)
    assert any("GatedDeltaNet chunk" in x and "'gateddeltanet'" in x for x in found)
    assert any("'linear_attention'" in x for x in found) and any("'mlp'" in x for x in found)


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
