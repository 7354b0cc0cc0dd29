"""registry.yaml: kind -> name -> "module:attr". Loads lazily; knows no component by name.

Users extend it without editing the package: a user registry file (same format) named by
`registry=PATH` (command line or recipe) or by the environment variable APIARY_REGISTRY
(paths separated by os.pathsep) adds names of the existing kinds, bound to their own modules;
the file's folder is put on sys.path, so `target: my_losses:MyLoss` finds my_losses.py beside it.
Every entry records where it came from (`source`: registry.yaml or the user file's path).
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import lru_cache
from pathlib import Path

import yaml

from framework import contracts
from framework.contracts import GROUP_KINDS  # noqa: F401  (kinds whose choice is a config group)
from framework.errors import UserError, did_you_mean

CODE_ROOT = Path(__file__).resolve().parents[2]  # where framework/, components/ and toolkit/ are


def _data_root() -> Path:
    """Where registry.yaml, recipes/, docs/skills/ and launchers/ are: the source tree (a clone, an
    editable install), else the folder a wheel installs them to (``share/apiary`` under the
    environment's prefix, or the user's base for ``pip install --user``)."""
    import site  # reason: only needed when the source tree is not where the code is

    for d in (CODE_ROOT, Path(sys.prefix) / "share" / "apiary", Path(site.getuserbase()) / "share" / "apiary"):
        if (d / "registry.yaml").is_file():
            return d
    return CODE_ROOT


ROOT = _data_root()
REGISTRY_PATH = ROOT / "registry.yaml"
ENV_VAR = "APIARY_REGISTRY"
_USED: list[Path] = []  # user registry files merged so far, in order


@lru_cache(maxsize=None)
def entries() -> dict[str, dict[str, dict[str, str]]]:
    with open(REGISTRY_PATH) as f:
        out = yaml.safe_load(f)
    for names in out.values():
        for e in names.values():
            e.setdefault("source", "registry.yaml")
    for p in filter(None, os.environ.get(ENV_VAR, "").split(os.pathsep)):
        _merge(out, Path(p), where=f"{ENV_VAR}={p}")
    return out


def use(path: str | os.PathLike, where: str | None = None) -> None:
    """Merge a user registry file into entries() (once per file)."""
    p = Path(path).expanduser().resolve()
    if p in _USED:
        return
    _merge(entries(), p, where=where or f"registry={path}")


def _merge(out: dict, path: Path, where: str) -> None:
    path = path.expanduser().resolve()
    if path in _USED:
        return
    if not path.is_file():
        raise UserError(where, f"no user registry file at {path}.",
                        "Point it at a YAML file of kind -> name -> {target: module:attr, doc: ...}.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(where, f"{path} is not valid YAML: {str(e).splitlines()[0]}.") from None
    if not isinstance(data, dict):
        raise UserError(where, f"{path} must map kind -> name -> {{target, doc}}.")
    for kind, names in data.items():
        if kind not in out:
            raise UserError(where, f"unknown component kind {kind!r} in {path}; kinds: {', '.join(out)}.",
                            did_you_mean(str(kind), out))
        if names is not None and not isinstance(names, dict):
            raise UserError(f"{where}: {kind}", f"in {path}, {kind} must map each name to {{target: module:attr, "
                            f"doc: ...}}, not a {type(names).__name__}.",
                            f"For example:\n{kind}:\n  my_name:\n    target: my_module:MyClass")
        for name, e in (names or {}).items():
            if not isinstance(e, dict) or not isinstance(e.get("target"), str) or not e["target"].strip():
                raise UserError(f"{where}: {kind}.{name}", f"needs `target: module:attr` in {path}.",
                                "For example: target: my_losses:ScaledCE")
            if name in out[kind]:
                raise UserError(f"{where}: {kind}.{name}", f"{kind} {name!r} is already defined by "
                                f"{out[kind][name]['source']}; a user registry adds names, it does not replace them.",
                                "Choose another name.")
            out[kind][name] = {"target": e["target"], "doc": str(e.get("doc", "")), "source": str(path)}
            if e.get("skill"):  # the user's page: a markdown file, relative to their registry file
                out[kind][name]["skill"] = str(e["skill"])
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # the user's modules beside their registry file
    _USED.append(path)


def names(kind: str) -> list[str]:
    return list(entries()[kind])


def family_of(model_type: str) -> str | None:
    """The model family whose declared ``HF_MODEL_TYPES`` (the model contract) holds ``model_type``, a
    config.json's: registry.yaml's families first, then the user registries'; None when none reads it."""
    for family in names("model"):
        if model_type in contracts.member(resolve("model", family), "model", "HF_MODEL_TYPES"):
            return family
    return None


def model_types() -> list[str]:
    """Every config.json ``model_type`` some model family of the registries declares it reads."""
    return sorted({t for family in names("model")
                   for t in contracts.member(resolve("model", family), "model", "HF_MODEL_TYPES")})


def doc(kind: str, name: str) -> str:
    return entries()[kind][name]["doc"]


def skill_page(kind: str, name: str) -> Path:
    """The page that explains kind/name: docs/skills/<skill or name>.md for registry.yaml's names
    (``skill:`` where several names share a page, e.g. the policy losses' one page); a user entry's
    ``skill:`` is a file relative to its registry file. The path may not exist (a user's name)."""
    e = entries()[kind][name]
    if e.get("source", "registry.yaml") != "registry.yaml":
        return Path(e["source"]).parent / e.get("skill", f"{name}.md")
    return ROOT / "docs" / "skills" / f"{e.get('skill') or name}.md"


def check(kind: str, name: str, where: str | None = None) -> None:
    known = entries().get(kind)
    if known is None:
        raise UserError(where or kind, f"unknown component kind {kind!r}.", did_you_mean(kind, entries()))
    if name not in known:
        users = f" and {', '.join(map(str, _USED))}" if _USED else ""
        raise UserError(
            where or kind,
            f"unknown {kind} {name!r}; registry.yaml{users} list {', '.join(known)}."
            if users else f"unknown {kind} {name!r}; registry.yaml lists {', '.join(known)}.",
            did_you_mean(name, known) or "A name of your own goes in a user registry file: registry=PATH "
            f"or {ENV_VAR}=PATH.",
        )


def resolve(kind: str, name: str, where: str | None = None):
    """Import the object bound to kind/name."""
    check(kind, name, where)
    e = entries()[kind][name]
    module, _, attr = e["target"].partition(":")
    if e.get("source", "registry.yaml") == "registry.yaml":
        obj = importlib.import_module(module)
        return getattr(obj, attr) if attr else obj
    try:  # a user's module: its import errors are the user's to fix
        obj = importlib.import_module(module)
        return getattr(obj, attr) if attr else obj
    except (ImportError, AttributeError) as err:
        raise UserError(where or f"{kind}={name}", f"cannot import {e['target']} (from {e['source']}): {err}.",
                        f"Put {module}.py beside {e['source']} or on PYTHONPATH.") from None
    except UserError:
        raise
    except SystemExit as err:  # sys.exit() at import: the whole command would end, silently
        raise UserError(where or f"{kind}={name}", f"importing {e['target']} (from {e['source']}) called "
                        f"sys.exit({err.code!r}): a module a registry names may not end the process on import.",
                        f"Move that code of {module} under `if __name__ == \"__main__\":`.") from None
    except Exception as err:  # noqa: BLE001 (any error in the user's module at import)
        raise UserError(where or f"{kind}={name}", f"importing {e['target']} (from {e['source']}) raised "
                        f"{type(err).__name__}: {err}.", f"Fix {module}; `python -c 'import {module}'` beside "
                        f"{e['source']} shows the traceback.") from None


def options_of(kind: str, name: str):
    """The ``Options`` (a declared member: contracts) of kind/name; None for an object without one
    (a user's registry entry that resolve would refuse), which the listings skip."""
    try:
        return contracts.member(resolve(kind, name), kind, "Options")
    except AttributeError:
        return None
