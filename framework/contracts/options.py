"""Options helpers: a component's ``Options`` over the schema's section, its ``Literal`` choices and
field docs (OmegaConf has no Literal type; the recipe schema stores the base type).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import linecache
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf

from framework.compose import schema

# ---------------------------------------------------------------------------------------------
# Options helpers (OmegaConf has no Literal type; the recipe schema stores the base type)
# ---------------------------------------------------------------------------------------------


def choices(tp: Any) -> tuple | None:
    """The values of a ``Literal[...]`` annotation (``Optional[Literal[...]]`` too), else None."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        for a in typing.get_args(tp):
            if typing.get_origin(a) is Literal:
                return typing.get_args(a)
    return None


def check_choices(obj: Any, prefix: str, where: str = "") -> None:
    """ValueError naming ``prefix + field`` for a field outside its ``Literal`` choices
    (call it first in an Options' ``__post_init__``)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        names = choices(hints.get(f.name))
        value = getattr(obj, f.name)
        if names is not None and value is not None and value not in names:
            raise ValueError(f"{prefix}{f.name} must be {'|'.join(map(str, names))}{where}, got {value!r}")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's doc: the string literal after it (torchtitan's style), or its ``# comment`` block
    on the lines right above it followed by the comment on its own (last) line, read from the class's
    source and its bases' (empty where the source cannot be read)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            src = textwrap.dedent(_class_source(klass))
        except (OSError, TypeError):
            continue
        lines = src.splitlines()
        body = ast.parse(src).body[0].body
        for stmt, nxt in zip(body, [*body[1:], None]):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
                continue
            parts = _comments_above(lines, stmt.lineno - 1)
            if "#" in lines[stmt.end_lineno - 1]:
                parts = [": ".join(filter(None, (" ".join(parts), lines[stmt.end_lineno - 1].split("#", 1)[1].strip())))]
            if any(parts):
                docs[stmt.target.id] = " ".join(parts)
    return docs


def _comments_above(lines: list[str], index: int) -> list[str]:
    """The texts of the unbroken run of ``#`` comment lines right above ``lines[index]``, in order."""
    out: list[str] = []
    while index > 0 and lines[index - 1].lstrip().startswith("#"):
        index -= 1
        out.insert(0, lines[index].lstrip()[1:].strip())
    return out


@functools.lru_cache(maxsize=None)
def _classes_in(path: str) -> tuple[list[str], dict[str, ast.ClassDef]]:
    """A source file's lines and its classes by qualified name, parsed once per file (`train --help`
    reads the docs of some 40 classes in a dozen files; inspect.getsource parses the file for each)."""
    lines = linecache.getlines(path)
    out: dict[str, ast.ClassDef] = {}

    def walk(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(prefix + node.name, node)
                walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(node.body, f"{prefix}{node.name}.<locals>.")

    walk(ast.parse("".join(lines)).body, "")
    return lines, out


def _class_source(klass: type) -> str:
    """``inspect.getsource(klass)`` from the class statement on, through a per-file cache."""
    path = inspect.getsourcefile(klass)
    if path is not None:
        lines, classes = _classes_in(path)
        node = classes.get(klass.__qualname__)
        if node is not None:
            return "".join(lines[node.lineno - 1: node.end_lineno])
    return inspect.getsource(klass)


def schema_of(options_cls: type) -> type:
    """A dataclass OmegaConf can type-check: ``options_cls`` with ``Literal`` fields as ``str``
    (their choices are checked by ``options_cls.__post_init__``) and no ``__post_init__``."""
    hints = typing.get_type_hints(options_cls)
    out = []
    for f in dataclasses.fields(options_cls):
        tp = hints[f.name]
        names = choices(tp)
        if names is not None:
            base = type(names[0])
            tp = typing.Optional[base] if type(None) in typing.get_args(tp) else base
        default = (f.default if f.default is not dataclasses.MISSING else
                   field(default_factory=f.default_factory) if f.default_factory is not dataclasses.MISSING
                   else dataclasses.MISSING)
        out.append((f.name, tp) if default is dataclasses.MISSING else (f.name, tp, default))
    return dataclasses.make_dataclass(f"{options_cls.__qualname__.replace('.', '_')}_schema", out, kw_only=True)


@functools.lru_cache(maxsize=None)
def _over_section(options_cls: type, section: type) -> type:
    """``options_cls`` (a component's validator of a shared section: its ``__post_init__``, no keys of
    the section) with the keys, types and defaults of ``section`` (the framework's schema dataclass of
    that section, their one definition): an instance of ``options_cls`` that has the section's fields."""
    combined = type(options_cls.__name__, (options_cls, section),
                    {"__module__": options_cls.__module__, "__qualname__": options_cls.__qualname__,
                     "__doc__": options_cls.__doc__})
    return dataclass(kw_only=True)(combined)


def _schema_section(node: Any) -> type | None:
    """The schema dataclass of a recipe section: its node's type, or, in an untyped config (a run's
    resolved file read back), the type of the ``RecipeConfig`` field its key names; None for a
    component group (typed by its ``Options``) or anything else."""
    if not isinstance(node, DictConfig):
        return None
    t = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(t):
        return t
    parent = node._get_parent()
    if parent is None or parent._get_parent() is not None:  # a top-level section of the recipe only
        return None
    t = typing.get_type_hints(schema.RecipeConfig).get(node._key())
    return t if dataclasses.is_dataclass(t) else None


def options_class(component: Any, node: Any) -> type:
    """The class ``make_options`` builds for ``component`` from ``node``: its ``Options``, or, for a
    section the framework's schema types and several kinds share (``model``, ``data``, ``moe``:
    ``SELECT``), its ``Options`` over that schema dataclass, whose keys the ``Options`` does not repeat."""
    cls = component.Options
    section = _schema_section(node)
    if section is not None and not issubclass(cls, section):
        own = {f.name for f in dataclasses.fields(cls)}
        if any(f.name not in own for f in dataclasses.fields(section)):
            return _over_section(cls, section)
    return cls


def make_options(component: Any, node: Any) -> Any:
    """``component.Options`` built from a recipe section (the keys it declares; for a shared section
    the schema's keys too, ``options_class``); ValueError from its ``__post_init__`` when a value is
    out of range."""
    cls = options_class(component, node)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in node:
            v = node[f.name]
            kw[f.name] = OmegaConf.to_container(v) if isinstance(v, (DictConfig, ListConfig)) else v
    return cls(**kw)
