"""Reads framework/, components/ and toolkit/ with ``ast`` for the three kinds of reach into a
third-party library's internals that framework/compat/ claims to hold (tests/test_compat_scan.py):

- a **patch**: an assignment (``=``, ``+=``, ``del``, ``setattr``/``delattr``, an object's ``__dict__``)
  to an attribute of a third-party module or class (a name imported from one), or to an attribute of
  an object apiary did not define (not ``self``/``cls``, not a function or class of the file) that
  replaces behaviour (a function, a lambda, a list of them, what a local factory of functions
  returns) or is private (``_name``, not one apiary owns);
- a **private override**: a method ``_name`` of a class derived from a third-party class (or from a
  base only known at run time) that the third-party base defines too;
- a **private read**: ``x._name`` (or ``getattr(x, "_name")``) where ``x`` is a third-party module or
  class, ``self`` of a class derived from one (a name the class does not define), or an object of
  unknown type and ``_name`` is no private name apiary defines.

apiary's own private names: what a ``def``, a ``class``, a module-level or class-level assignment or a
``self.``/``cls.`` assignment in a class of its own defines, anywhere in the three packages, and
every name starting ``_apiary_`` (its attributes on library objects). Each finding is
``(file, line, kind, attr, what)``; kind is ``patch``, ``override`` or ``read``.
"""

from __future__ import annotations

import ast
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

THIRD_PARTY = ("torch", "torchtitan", "triton", "hydra", "omegaconf", "fla", "vllm", "torchao",
               "transformer_engine", "deep_ep", "spmd_types", "safetensors", "transformers", "rich")
OWN = ("framework", "components", "toolkit")
NEUTRAL_BASES = {"object", "Exception", "RuntimeError", "ValueError", "Protocol", "NamedTuple", "ABC", "Enum",
                 "Generic", "TypedDict", "dict", "list", "tuple", "str", "int", "float"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass
class _Class:
    name: str
    file: str
    module: str
    bases: list  # each: ("own", "module:Name") | ("third", "module:attr.path") | ("unknown", text) | ("neutral", text)
    members: set = field(default_factory=set)
    methods: dict = field(default_factory=dict)  # name -> line
    stored: set = field(default_factory=set)  # what its methods assign to self./cls.
    super_calls: set = field(default_factory=set)  # the methods that call super().<their own name>


def _module_of(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, module: str) -> dict[str, str]:
    """local name -> "module" (an imported module) or "module:attr" (a name imported from one)."""
    out = {}
    package = module if module.endswith("__init__") else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = module.split(".")[:-node.level] if module else []
                mod = ".".join([*base, *([mod] if mod else [])])
            for a in node.names:
                out[a.asname or a.name] = f"{mod}:{a.name}"
    del package
    return out


def _origin(node, imports: dict[str, str]) -> str | None:
    """The dotted origin of a Name/Attribute chain that starts at an imported name."""
    if isinstance(node, ast.Name):
        return imports.get(node.id)
    if isinstance(node, ast.Attribute):
        inner = _origin(node.value, imports)
        if inner is None:
            return None
        return f"{inner}.{node.attr}" if ":" in inner else f"{inner}:{node.attr}"
    return None


def _top(origin: str) -> str:
    return origin.split(":")[0].split(".")[0]


class Scan:
    def __init__(self, root: Path, skip: tuple[str, ...] = ("framework/compat/",)):
        self.root = root
        self.files: dict[str, ast.Module] = {}
        for top in OWN:
            for path in sorted((root / top).rglob("*.py")):
                rel = path.relative_to(root).as_posix()
                self.files[rel] = ast.parse(path.read_text(), rel)
        self.skip = skip
        self.imports = {rel: _imports(t, _module_of(Path(rel))) for rel, t in self.files.items()}
        self.classes: dict[str, _Class] = {}  # "module:Name" -> class
        self.own_names: set[str] = set()
        self.class_data: set[str] = set()  # attributes an apiary class declares in its body (not methods)
        for rel, tree in self.files.items():
            self._index(rel, tree)

    # ------------------------------------------------------------------ index of apiary's own names
    def _index(self, rel: str, tree: ast.Module) -> None:
        module = _module_of(Path(rel))
        imports = self.imports[rel]
        local_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.own_names.add(node.name)
            if isinstance(node, ast.ClassDef):
                bases = []
                for b in node.bases:
                    o = _origin(b, imports)
                    if isinstance(b, ast.Name) and b.id in local_classes:
                        bases.append(("own", f"{module}:{b.id}"))
                    elif o is not None and _top(o) in OWN:
                        bases.append(("own", o))
                    elif o is not None and _top(o) in THIRD_PARTY:
                        bases.append(("third", o))
                    elif (isinstance(b, ast.Name) and b.id in NEUTRAL_BASES) or (o is not None and _top(o) not in OWN):
                        bases.append(("neutral", ast.unparse(b)))
                    elif isinstance(b, ast.Subscript):
                        bases.append(("neutral", ast.unparse(b)))
                    else:
                        bases.append(("unknown", ast.unparse(b)))
                c = _Class(node.name, rel, module, bases)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        c.members.add(item.name)
                        c.methods[item.name] = item.lineno
                        if any(isinstance(n, ast.Attribute) and n.attr == item.name and isinstance(n.value, ast.Call)
                               and isinstance(n.value.func, ast.Name) and n.value.func.id == "super"
                               for n in ast.walk(item)):
                            c.super_calls.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for t in (item.targets if isinstance(item, ast.Assign) else [item.target]):
                            for n in ast.walk(t):
                                if isinstance(n, ast.Name):
                                    c.members.add(n.id)
                                    self.own_names.add(n.id)
                                    self.class_data.add(n.id)
                for n in ast.walk(node):
                    if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                            and n.value.id in ("self", "cls"):
                        c.members.add(n.attr)
                        c.stored.add(n.attr)
                        self.own_names.add(n.attr)
                self.classes[f"{module}:{node.name}"] = c
        for item in tree.body:  # module level
            targets = item.targets if isinstance(item, ast.Assign) else [item.target] \
                if isinstance(item, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                self.own_names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))

    def _resolve_own(self, ref: str) -> _Class | None:
        """An own class by "module:Name", following a package's re-export."""
        if ref in self.classes:
            return self.classes[ref]
        module, _, name = ref.partition(":")
        for rel, imports in self.imports.items():
            if _module_of(Path(rel)) == module and name in imports:
                return self._resolve_own(imports[name]) if ":" in imports[name] else None
        return None

    def third_bases(self, c: _Class, seen=None) -> tuple[list[str], list[str]]:
        """(the third-party bases among its ancestors, the bases only known at run time)."""
        seen = seen if seen is not None else set()
        third, unknown = [], []
        for kind, ref in c.bases:
            if kind == "third":
                third.append(ref)
            elif kind == "unknown":
                unknown.append(ref)
            elif kind == "own":
                parent = self._resolve_own(ref)
                if parent is not None and id(parent) not in seen:
                    seen.add(id(parent))
                    t, u = self.third_bases(parent, seen)
                    third += t
                    unknown += u
        return third, unknown

    def own_members(self, c: _Class, seen=None) -> set[str]:
        seen = seen if seen is not None else set()
        out = set(c.members)
        for kind, ref in c.bases:
            parent = self._resolve_own(ref) if kind == "own" else None
            if parent is not None and id(parent) not in seen:
                seen.add(id(parent))
                out |= self.own_members(parent, seen)
        return out

    def is_own_private(self, name: str) -> bool:
        return name.startswith("_apiary_") or name in self.own_names

    # ------------------------------------------------------------------ the findings
    def findings(self) -> list[tuple[str, int, str, str, str]]:
        out = []
        for rel, tree in self.files.items():
            if rel.startswith(self.skip):
                continue
            out += self._file_findings(rel, tree)
        return sorted(set(out))

    def _file_findings(self, rel, tree):
        imports = self.imports[rel]
        module = _module_of(Path(rel))
        found = []
        local_defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                        ast.ClassDef, ast.Lambda)) and hasattr(n, "name")}
        factories = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and _returns_function(n)}
        constants = {t.id: item.value.value for item in tree.body if isinstance(item, ast.Assign)
                     and isinstance(item.value, ast.Constant) and isinstance(item.value.value, str)
                     for t in item.targets if isinstance(t, ast.Name)}

        def attr_name(node):  # setattr/getattr's name argument, where it is known
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            if isinstance(node, ast.Name) and node.id in constants:
                return constants[node.id]
            o = _origin(node, imports)
            if o is not None and _top(o) in OWN:
                return _constant_of(self, o)
            return None

        def callable_value(v):
            if isinstance(v, ast.Lambda):
                return True
            if isinstance(v, ast.Name) and v.id in local_defs:
                return True
            if isinstance(v, (ast.List, ast.Tuple, ast.ListComp)):
                elts = [v.elt] if isinstance(v, ast.ListComp) else v.elts
                return any(callable_value(e) for e in elts)
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in factories:
                return True
            return False

        def receiver_own(recv, scope_class):
            if isinstance(recv, ast.Name) and recv.id in ("self", "cls") and scope_class is not None:
                return True
            if isinstance(recv, ast.Name) and recv.id in local_defs:
                return True
            return False

        for scope_class, node in _walk_with_class(tree):
            # -------------------------------------------------------------- patches
            stores = []  # (receiver, attr or None, value or None)
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                            stores.append((n.value, n.attr, node.value, n))
                        if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and \
                                isinstance(n.value, ast.Attribute) and n.value.attr == "__dict__":
                            key = attr_name(n.slice)
                            stores.append((n.value.value, key if key and self.is_own_private(key) else "__dict__",
                                           node.value, n))
            elif isinstance(node, ast.Delete):
                for t in node.targets:
                    if isinstance(t, ast.Attribute):
                        stores.append((t.value, t.attr, None, t))
                    elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) \
                            and t.value.attr == "__dict__":
                        stores.append((t.value.value, "__dict__", None, t))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                    and len(node.args) >= 2:
                stores.append((node.args[0], attr_name(node.args[1]), node.args[2] if len(node.args) > 2 else None, node))
            for recv, attr, value, where in stores:
                o = _origin(recv, imports)
                if o is not None and _top(o) in THIRD_PARTY:
                    found.append((rel, node.lineno, "patch", attr or "?", f"{o}.{attr}"))
                    continue
                if receiver_own(recv, scope_class) or (o is not None and _top(o) in OWN) or attr in self.class_data:
                    continue  # an attribute an apiary class declares (its type is apiary's, whatever the receiver)
                if attr == "__dict__" or (attr and _private(attr) and not self.is_own_private(attr)) \
                        or (value is not None and callable_value(value)):
                    found.append((rel, node.lineno, "patch", attr or "?", ast.unparse(where)[:80]))
            # -------------------------------------------------------------- private reads
            reads = []
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr):
                reads.append((node.value, node.attr))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                    and len(node.args) >= 2:
                a = attr_name(node.args[1])
                if a and _private(a):
                    reads.append((node.args[0], a))
            for recv, attr in reads:
                o = _origin(recv, imports)
                if o is not None:
                    if _top(o) in THIRD_PARTY:
                        found.append((rel, node.lineno, "read", attr, f"{o}.{attr}"))
                    continue  # apiary's own module or the standard library
                if isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name) and recv.func.id == "super":
                    recv = ast.Name("self")
                if isinstance(recv, ast.Name) and recv.id in ("self", "cls") and scope_class is not None:
                    c = self.classes.get(f"{module}:{scope_class}")
                    if c is not None and (attr in self.own_members(c) or attr.startswith("_apiary_")):
                        continue
                    third, unknown = self.third_bases(c) if c is not None else ([], [])
                    if third or unknown:
                        found.append((rel, node.lineno, "read", attr, f"{scope_class}({', '.join(third + unknown)}).{attr}"))
                        continue
                if not self.is_own_private(attr):
                    found.append((rel, node.lineno, "read", attr, ast.unparse(recv)[:60] + "." + attr))
            # -------------------------------------------------------------- private overrides
            if isinstance(node, ast.ClassDef):
                c = self.classes.get(f"{module}:{node.name}")
                third, unknown = self.third_bases(c)
                for name, line in c.methods.items():
                    if not _private(name):
                        continue
                    over = [b for b in third if _has(b, name)]
                    if over or (name in c.super_calls and not any(
                            name in self.own_members(p) for k, r in c.bases if k == "own"
                            for p in [self._resolve_own(r)] if p is not None)):
                        found.append((rel, line, "override", name,
                                      f"{node.name}({', '.join(over or third + unknown) or 'a mixin'}).{name}"))
                for name in sorted(c.stored - set(c.methods)):
                    over = [b for b in third if _private(name) and _has(b, name)]
                    if over:
                        found.append((rel, node.lineno, "override", name, f"{node.name}({', '.join(over)}).{name}"))
        return found


def _constant_of(scan: Scan, origin: str) -> str | None:
    """The string value of an own module's constant "module:NAME" (a channel's attribute name)."""
    module, _, name = origin.partition(":")
    if "." in name:
        return None
    for rel, tree in scan.files.items():
        if _module_of(Path(rel)) == module:
            for item in tree.body:
                if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant) and \
                        any(isinstance(t, ast.Name) and t.id == name for t in item.targets):
                    return item.value.value if isinstance(item.value.value, str) else None
            imp = scan.imports[rel].get(name)
            if imp and ":" in imp:
                return _constant_of(scan, imp)
    return None


def _returns_function(fn) -> bool:
    """A factory of functions: it returns a function it defines (or a lambda)."""
    inner = {n.name for n in ast.walk(fn) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not fn}
    for n in ast.walk(fn):
        if isinstance(n, ast.Return) and n.value is not None and \
                (isinstance(n.value, ast.Lambda) or (isinstance(n.value, ast.Name) and n.value.id in inner)):
            return True
    return False


def _walk_with_class(tree):
    """Every node with the name of the innermost class whose method it is in (None outside one)."""
    stack = [(tree, None)]
    while stack:
        node, cls = stack.pop()
        yield cls, node
        for child in ast.iter_child_nodes(node):
            stack.append((child, child.name if isinstance(child, ast.ClassDef) else cls))


def _has(target: str, name: str) -> bool:
    """Whether the third-party object "module:attr.path" has ``name`` (importing it; False where it
    cannot be imported here)."""
    module, _, path = target.partition(":")
    try:
        obj = importlib.import_module(module)
        for p in path.split("."):
            obj = getattr(obj, p)
    except (ImportError, AttributeError):
        return False  # not importable here (an optional library): only an evident override counts
    return hasattr(obj, name)


if __name__ == "__main__":
    for f in Scan(Path(sys.argv[1] if len(sys.argv) > 1 else ".")).findings():
        print(*f)
