"""framework/compat/'s claim, read from the code (tests/compat_scan.py): no module outside it patches a
third-party module, class or object; every private name of a library read or overridden elsewhere is
listed in ``compat.PRIVATE_NAMES`` / ``compat.PRIVATE_OVERRIDES`` with its files and why; no entry
there is stale. The scan tells apiary's own private names from a library's by the imports, the
classes' bases and the names apiary defines; where it cannot know a receiver's type, ``ALLOWED``
says why the finding is not a reach into a third party's internals."""

from __future__ import annotations

import ast

import pytest
from compat_scan import Scan

from framework import compat

from conftest import ROOT

# (file, attribute) -> why the scan's finding there is none
ALLOWED = {
    ("components/adapters/lora.py", "post_optimizer_build_fn"):
        "torchtitan's ModelSpec field for a function run once the optimizers exist: a hook it offers for this, "
        "set as designed (the previous one chained)",
    ("components/precision/policies.py", "post_optimizer_build_fn"): "as above",
    ("framework/contracts/members.py", "_is_protocol"): "typing's flag on a Protocol class (the standard library)",
}


@pytest.fixture(scope="module")
def findings():
    return Scan(ROOT).findings()


def _listed(kind: str, rel: str, attr: str) -> bool:
    table = compat.PRIVATE_OVERRIDES if kind == "override" else compat.PRIVATE_NAMES
    return any(target.replace(":", ".").rsplit(".", 1)[1] == attr and rel in files
               for target, (files, _why) in table.items())


def test_no_patch_outside_compat(findings):
    found = [f"{rel}:{line} {what}" for rel, line, kind, attr, what in findings
             if kind == "patch" and (rel, attr) not in ALLOWED]
    assert not found, "patches of a library's module, class or object outside framework/compat/ (move them there):\n" \
        + "\n".join(found)


def test_every_private_read_and_override_is_listed(findings):
    found = [f"{rel}:{line} {kind} {what}" for rel, line, kind, attr, what in findings
             if kind in ("read", "override") and (rel, attr) not in ALLOWED and not _listed(kind, rel, attr)]
    assert not found, "private names of a library read or overridden, not in compat.PRIVATE_NAMES / " \
        "PRIVATE_OVERRIDES (framework/compat/listed.py: the target, the files, why):\n" + "\n".join(found)


def test_no_listed_entry_is_stale(findings):
    """Each listed file still reads (or overrides) the name, and each ALLOWED entry still matches."""
    seen = {(rel, attr) for rel, _line, _kind, attr, _what in findings}
    imported = set()  # names imported, or named in a string (getattr of a module from sys.modules)
    for rel, tree in Scan(ROOT).files.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                imported |= {(rel, a.name) for a in node.names}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                imported.add((rel, node.value))
    stale = [f"{target} in {rel}" for table in (compat.PRIVATE_NAMES, compat.PRIVATE_OVERRIDES)
             for target, (files, _why) in table.items() for rel in files
             if (rel, target.replace(":", ".").rsplit(".", 1)[1]) not in seen | imported]
    stale += [f"ALLOWED {key}" for key in ALLOWED if key not in seen]
    assert not stale, "listed but no longer there (remove the entry):\n" + "\n".join(stale)


SAMPLES = {
    "patch": ["import torch\ntorch.nn.Linear.forward = None\n",
              "def f(m):\n    def fwd(x):\n        return x\n    m.forward = fwd\n",
              "def f(m):\n    m._sharding_config = 1\n",
              "def f(m):\n    del m.__dict__['forward']\n"],
    "override": ["from torchtitan.components.metrics import MetricsProcessor\n"
                 "class M(MetricsProcessor):\n    def _build_metric_logger(self):\n        return 1\n",
                 "class Mixin:\n    def _init_self_parameters(self):\n        super()._init_self_parameters()\n"],
    "read": ["from torchtitan.models import qwen3\nx = qwen3._qwen3_norm\n",
             "def f(d):\n    return d._unpermute\n",
             "from torchtitan.components.optimizer import OptimizersContainer\n"
             "class O(OptimizersContainer):\n    def g(self):\n        return self._build_impl_kwargs\n"],
    None: ["class A:\n    _x = 1\n    def _own(self):\n        return self._x + self._y\n    def g(self):\n"
           "        self._y = 2\n        return self._own()\n",
           "def f(m):\n    m._apiary_mark = 1\n    return m._apiary_mark\n",
           "import os\nos._exit(0)\n"],
}


@pytest.mark.parametrize("kind,source", [(k, s) for k, ss in SAMPLES.items() for s in ss])
def test_the_scan_sees_each_kind(kind, source, tmp_path):
    """The scan on a one-file package: each sample is found as its kind (None: nothing found)."""
    (tmp_path / "components").mkdir()
    (tmp_path / "components" / "sample.py").write_text(source)
    for top in ("framework", "toolkit"):
        (tmp_path / top).mkdir()
    kinds = {f[2] for f in Scan(tmp_path).findings()}
    assert kinds == ({kind} if kind else set()), f"{source!r}: found {kinds}"
