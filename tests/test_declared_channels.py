"""What one part of apiary leaves for another by name is declared in framework/contracts/: the facts a
component's check leaves for another kind (``ctx.shared``: ``contracts.Shared``'s fields, never a
string key), the facts a component's plan terms tell the planner (``PlanTerms.facts``:
``contracts.PlanFacts``'s fields, never a string key), and the members of a component's objects
the framework or the tools read (a Protocol: ``isinstance``, or ``contracts.member``; never a
``getattr``/``hasattr`` probe, nor a comparison with a dataclass field's name)."""

from __future__ import annotations

import ast
import dataclasses

import pytest

from framework import contracts

from conftest import ROOT

# attribute names that components define too, read by a probe on a library's object (not a component's)
LIBRARY_ATTRS = {
    "dataset": "torch's DataLoader.dataset",
    "dtype": "a tensor's",
    "save": "torchtitan's CheckpointManager.save (a test's stand-in has none)",
    "load_state_dict": "torchtitan's optimizer and schedule containers (a plain list in unit tests)",
    "name": "a recipe section's `name` key (an OmegaConf node: the component chosen)",
    "vocab_size": "torchtitan's model config",
    "grad_accum": "the planner's read of the resolved run (framework/plan/, another change)",
}


def _trees(*tops):
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def _component_members() -> set[str]:
    """Names a component module defines at module or class level (its members and its objects')."""
    out = set()
    for _rel, tree in _trees("components"):
        for node in ast.walk(tree):
            body = tree.body if node is tree else node.body if isinstance(node, ast.ClassDef) else []
            for item in body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for t in (item.targets if isinstance(item, ast.Assign) else [item.target]):
                        out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def undeclared_shared(trees) -> list[str]:
    fields = {f.name for f in dataclasses.fields(contracts.Shared)} | {"plain"}
    found = []
    for rel, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "shared" \
                    and node.attr not in fields:
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shared":
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return found


def member_probes(trees, members: set[str]) -> list[str]:
    found = []
    for rel, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
                if name in members and not name.startswith("__") and name not in LIBRARY_ATTRS:
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return found


def undeclared_plan_facts(trees) -> list[str]:
    """Plan facts written or read other than as a declared ``PlanFacts`` field: ``PlanFacts(name=...)``,
    ``PlanTerms(facts={"name": ...})``, ``x.facts.name = ...`` with an undeclared name; any
    ``x.facts["name"]`` or ``x.facts.get("name")`` (a string key)."""
    fields = {f.name for f in dataclasses.fields(contracts.PlanFacts)}
    found = []
    for rel, tree in trees:
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', 0)} "
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "PlanFacts":
                found += [where + f"PlanFacts({k.arg}=...)" for k in node.keywords if k.arg is not None and k.arg not in fields]
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "PlanTerms":
                for k in node.keywords:
                    if k.arg == "facts" and isinstance(k.value, ast.Dict):
                        found += [where + f"PlanTerms(facts={{{key.value!r}: ...}})" for key in k.value.keys
                                  if not (isinstance(key, ast.Constant) and key.value in fields)]
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute) and t.value.attr == "facts" \
                            and t.attr not in fields:
                        found.append(where + ast.unparse(t))
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "facts" \
                    and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                found.append(where + ast.unparse(node))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "facts":
                found.append(where + ast.unparse(node))
    return found


def field_probes(trees, members: set[str]) -> list[str]:
    """A comparison of a name a component defines with a dataclass field's or an object's ``.name``
    (``f.name == "budget_gib"`` over ``dataclasses.fields(Options)``): a probe of a component's option."""
    found = []
    for rel, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            ops = [node.left, *node.comparators]
            named = any(isinstance(n, ast.Attribute) and n.attr == "name"
                        or isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "fields"
                        for o in ops for n in ast.walk(o))
            found += [f"{rel}:{node.lineno} {ast.unparse(node)}" for o in ops
                      if named and isinstance(o, ast.Constant) and o.value in members and o.value not in LIBRARY_ATTRS]
    return found


def test_every_plan_fact_is_a_declared_field():
    found = undeclared_plan_facts(_trees("framework", "components", "toolkit"))
    assert not found, "a plan fact written or read other than by a contracts.PlanFacts field (declare it there):\n" \
        + "\n".join(found)


def test_plan_facts_refuse_an_undeclared_key():
    assert contracts.PlanTerms(facts={"objective": "cross_entropy"}).facts == contracts.PlanFacts(objective="cross_entropy")
    with pytest.raises(TypeError):
        contracts.PlanFacts(something_else=1)
    with pytest.raises(TypeError):  # a mapping is taken as PlanFacts(**mapping)
        contracts.PlanTerms(facts={"objective": "cross_entropy", "something_else": 1})
    terms = contracts.PlanTerms()
    terms.facts.objective = "cross_entropy"
    with pytest.raises(AttributeError):
        terms.facts.something_else = 1  # slots: not declared


def test_every_shared_fact_is_a_declared_field():
    found = undeclared_shared(_trees("framework", "components", "toolkit"))
    assert not found, "ctx.shared read or written other than by a contracts.Shared field (declare it there):\n" \
        + "\n".join(found)


def test_shared_refuses_an_undeclared_fact():
    shared = contracts.Shared()
    shared.adapter_base = {"kind": "dcp"}
    with pytest.raises(AttributeError):
        shared.something_else = 1  # noqa: B018 (slots: not declared)


def test_no_framework_or_tool_probes_a_component_member():
    trees, members = list(_trees("framework", "toolkit")), _component_members()
    assert "budget_gib" in members  # recompute=auto's option, once probed by the planner's preflight
    found = member_probes(trees, members) + field_probes(trees, members)
    assert not found, "getattr/hasattr of a component's member (declare it in framework/contracts: a Protocol " \
        "read with isinstance, or a member read with contracts.member):\n" + "\n".join(found)


def test_the_checks_see_an_undeclared_channel():
    sample = ast.parse('def f(ctx, trainer):\n    ctx.shared["x.y"] = 1\n    ctx.shared.other = 2\n'
                       '    return getattr(trainer.optimizers, "host_state_ready", None)\n')
    assert len(undeclared_shared([("s.py", sample)])) == 2
    assert len(member_probes([("s.py", sample)], {"host_state_ready"})) == 1
    probe = ast.parse('def h(opts):\n    budget = getattr(opts, "budget_gib", None)\n'
                      '    return budget, any(f.name == "budget_gib" for f in dataclasses.fields(opts))\n')
    assert len(member_probes([("s.py", probe)], {"budget_gib"})) == 1
    assert len(field_probes([("s.py", probe)], {"budget_gib"})) == 1
    facts = ast.parse('def g(t, n):\n    a = PlanTerms(facts={"comm": {}, "overlap2": {}})\n    b = PlanFacts(chunk=2)\n'
                      '    t.facts.summry = "x"\n    return t.facts["blocks"], t.facts.get("keep"), t.facts.blocks\n')
    assert len(undeclared_plan_facts([("s.py", facts)])) == 5
