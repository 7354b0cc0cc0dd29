"""A recipe file before Hydra composes it: where a recipe's name finds it (``recipe_path``; the packaged
ones, ``recipe_names``), its YAML read strictly (a key given twice is refused), the chain of recipes it
extends, the component groups it chooses, and the one-paragraph errors of a file that does not compose.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import yaml

from framework.compose import registry
from framework.compose.schema import DEFAULT_RECIPE, RecipeConfig
from framework.errors import UserError, did_you_mean

RECIPES_DIR = registry.ROOT / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def recipe_path(name: str, said: str = "recipe={}") -> Path:
    """The file ``name`` (a packaged recipe's name, or a path) names. ``said``: how the command that reads it
    writes a recipe in its fixes (`apiary show` takes ``"`apiary show {}`"``)."""
    p = Path(name)
    where = said.format(name).strip("`")
    if p.suffix in (".yaml", ".yml") or "/" in name:
        if not p.is_file():
            other = p.with_suffix(".yaml" if p.suffix == ".yml" else ".yml") if p.suffix else p.with_suffix(".yaml")
            if other.is_file():
                raise UserError(where, f"no recipe file at {p}. There is {other}: {said.format(other)}.",
                                "Copy one with `apiary cp NAME path`.")
            if (RECIPES_DIR / f"{p.stem}.yaml").is_file():  # recipe=debug_moe.yaml away from the checkout
                raise UserError(where, f"no recipe file at {p} (a path is read from this folder, "
                                f"{Path.cwd()}); {p.stem} is a packaged recipe, which is named without a "
                                f"path or suffix.", f"Write {said.format(p.stem)}, or copy it here to edit with "
                                f"`apiary cp {p.stem} {p.name}`.")
            raise UserError(where, f"no recipe file at {p}.", "Copy one with `apiary cp NAME path`.")
        if p.suffix != ".yaml":
            raise UserError(where, f"a recipe file is read by Hydra, which finds only files named *.yaml, "
                            f"and {p.name} ends in {p.suffix or 'no suffix'}.",
                            f"Rename it: mv {p} {p.with_suffix('.yaml')}, then {said.format(p.with_suffix('.yaml'))}.")
        return p.resolve()
    path = RECIPES_DIR / f"{name}.yaml"
    if "," in name and not path.is_file():  # was: "unknown recipe 'debug_moe,debug_dense'"
        raise UserError(where, "names several recipes; recipe= takes one, and a sweep (`train -m`) or "
                        "`apiary compare` varies keys within that one recipe.", "Run one command per recipe: "
                        + ", then ".join(said.format(r) for r in name.split(",")) + ".")
    if not path.is_file():
        here = next((f"{name}{ext}" for ext in (".yaml", ".yml") if Path(f"{name}{ext}").is_file()), None)
        raise UserError(  # a file beside it (`apiary cp debug_moe my_recipe.yaml`, then recipe=my_recipe)
            where, f"unknown recipe {name!r}; known recipes: {', '.join(recipe_names())}.",
            f"Did you mean {said.format(here)} (a file in this folder)?" if here
            else did_you_mean(name, recipe_names()) or "Run `apiary ls` to see them.")
    return path


def _check_yaml(path: Path, seen: set | None = None, chain: tuple = ()) -> None:
    """A recipe (and each recipe it extends) must parse as YAML: say file:line, not a traceback; and
    no recipe may extend itself, directly or through another (Hydra recurses until Python stops it)."""
    seen = set() if seen is None else seen
    if path.resolve() in chain:
        names = " -> ".join(p.stem for p in (*chain[chain.index(path.resolve()):], path.resolve()))
        raise UserError(f"recipe {chain[0]}", f"its `defaults:` list extends itself ({names}), so it never ends.",
                        "Name another recipe there (e.g. `defaults: [debug_moe, _self_]`), or _defaults.")
    if path in seen or not path.is_file():
        return
    seen.add(path)
    chain = (*chain, path.resolve())
    try:
        data = _read_yaml(path)
    except _DuplicateKey as e:
        m = e.problem_mark
        raise UserError(f"recipe {path}:{m.line + 1}:{m.column + 1}", f"sets {e.key!r} a second time in the same "
                        f"mapping (first at line {e.first_line + 1}); YAML would keep one of the two silently.",
                        "Keep one of them, then rerun.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise UserError(f"recipe {at}", f"is not valid YAML: {what}.",
                        "Fix the line (indentation, a missing ':' or closing bracket), then rerun.") from None
    except UnicodeDecodeError as e:
        raise UserError(f"recipe {path}", f"is not a text file: byte {e.object[e.start]:#04x} at offset {e.start} "
                        "is not UTF-8 (a binary file?); a recipe is a YAML text file.",
                        "Point recipe= at a .yaml recipe (`apiary ls` lists them; `apiary cp debug_moe "
                        "my_recipe.yaml` makes one to edit).") from None
    except OSError as e:
        raise UserError(f"recipe {path}", f"cannot be read: {e}.") from None
    if data is not None and not isinstance(data, dict):
        raise UserError(f"recipe {path}", f"must be a YAML mapping of keys to values, not a {type(data).__name__}.",
                        "Start from a copy: `apiary cp debug_moe my_recipe.yaml`.")
    for kind in registry.GROUP_KINDS:  # `loss: chunked` (was: "Merge error: str is not a subclass of ...")
        if isinstance(data, dict) and isinstance(data.get(kind), str):
            raise UserError(f"recipe {path}", f"sets `{kind}: {data[kind]}`, a name where apiary reads the section of "
                            f"the {kind} component (its name and options).", f"Write `{kind}: {{name: {data[kind]}}}` "
                            f"(its options beside name), or `override /{kind}: {data[kind]}` in the `defaults:` list "
                            "before _self_.")
    if isinstance(data, dict) and "hydra" in data:  # (was: taken by Hydra's composition and silently unused)
        raise UserError(f"recipe {path}", "has a `hydra:` section, which nothing reads: a run never starts Hydra's "
                        "app (it writes to output_dir), and a -m sweep reads hydra.sweep.* from its command line.",
                        "Drop the section; set output_dir=DIR for a run, or give hydra.sweep.dir=... and "
                        "hydra.sweep.subdir=... on a `train -m` command line.")
    for entry in (data or {}).get("defaults", []) or []:
        if isinstance(entry, str) and entry != "_self_":
            extended = path.parent / f"{entry}.yaml"
            if not extended.is_file() and not (RECIPES_DIR / f"{entry}.yaml").is_file() and entry != "_schema":
                raise UserError(f"recipe {path}", f"its `defaults:` list extends {entry!r}, which is neither a recipe "
                                f"file beside it ({extended}) nor a packaged recipe.",
                                did_you_mean(entry, recipe_names() + ["_defaults"]) or "`apiary ls` lists the recipes.")
                # (was: Hydra's "Could not load ... Config search path: provider=hydra, path=pkg://hydra.conf")
            _check_yaml(extended if extended.is_file() else RECIPES_DIR / f"{entry}.yaml", seen, chain)


class _DuplicateKey(yaml.constructor.ConstructorError):
    def __init__(self, key: str, first_line: int, mapping, mark):
        super().__init__("while constructing a mapping", mapping.start_mark, f"found duplicate key {key}", mark)
        self.key, self.first_line = key, first_line


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (Hydra's loader refuses it
    too, with a traceback; PyYAML alone keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    if key_node.value in seen:
                        raise _DuplicateKey(key_node.value, seen[key_node.value], node, key_node.start_mark)
                    seen[key_node.value] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path):
    return yaml.load(path.read_bytes().decode("utf-8"), Loader=_RecipeLoader)  # noqa: S506 (a SafeLoader)


_EXTEND_HINT = ("Start it with `defaults: [_defaults, _self_]` (or extend a recipe: `defaults: [debug_moe, "
                "_self_]`), or copy one to edit: `apiary cp debug_moe my_recipe.yaml`.")


def _check_recipe_file(path: Path) -> dict:
    """The recipe named by recipe= (after _check_yaml): not empty. Its mapping."""
    data = _read_yaml(path)
    if data is None:
        raise UserError(f"recipe {path}", "is empty (no settings, no `defaults:` list).", _EXTEND_HINT)
    return data


def read(path: Path) -> dict:
    """The recipe file ``recipe=`` names, checked before Hydra composes it: its YAML and the chain it
    extends (``_check_yaml``), then that it is not empty (``_check_recipe_file``); its mapping."""
    _check_yaml(path)
    return _check_recipe_file(path)


def _not_extending(path: Path, data: dict, why: str) -> UserError:
    """A recipe that extends neither _defaults nor a recipe, and cannot stand alone (``why``)."""
    what = ("has no `defaults:` list" if "defaults" not in data else
            "has a `defaults:` list that reaches neither _defaults nor a recipe")
    return UserError(f"recipe {path}", f"{what}, so it does not extend apiary's defaults, {why}.", _EXTEND_HINT)


def file_group_choices(path: Path, group_overrides: list[str]) -> tuple[list[str], list[str]]:
    """A recipe that chooses a component in its own section (``loss: {name: NAME, OPTION: VALUE}``):
    the same choice as ``defaults: [..., override /loss: NAME]``, so the section's other keys are
    that component's options. A group the command line chooses wins; the section's ``name`` then
    follows it. Returns the group overrides to compose with, and value overrides to add."""
    given = {g.partition("=")[0] for g in group_overrides}
    groups, extra = list(group_overrides), []
    if "defaults" not in (_read_yaml(path) or {}):  # a complete config (a run's config.yaml): no groups to choose
        return groups, extra
    for kind, (section, where) in _section_choices(path).items():
        if kind in given:
            chosen = [g.partition("=")[2] for g in group_overrides if g.partition("=")[0] == kind][-1]
            extra.append(f"{kind}.name={chosen}")
            continue
        registry.check(kind, section, where=f"recipe {where}: {kind}.name={section}")
        groups.insert(0, f"{kind}={section}")
    return groups, extra


def _section_choices(path: Path, seen: tuple = ()) -> dict[str, tuple[str, Path]]:
    """kind -> (name, file) for each group whose choice, in the recipe's chain, comes last from a file's
    own section (``loss: {name: ...}``) rather than from a ``defaults:`` entry (``override /loss: ...``,
    which Hydra applies itself): the files it extends first, then its defaults' overrides, then its
    own sections (merged at _self_)."""
    if path in seen or not path.is_file():
        return {}
    data = _read_yaml(path) or {}
    out: dict = {}
    for entry in data.get("defaults", []) or []:
        if isinstance(entry, str) and entry != "_self_":
            extended = path.parent / f"{entry}.yaml"
            out.update(_section_choices(extended if extended.is_file() else RECIPES_DIR / f"{entry}.yaml",
                                        (*seen, path)))
        elif isinstance(entry, dict):
            for k in entry:
                out.pop(str(k).removeprefix("override").strip().lstrip("/"), None)
    for kind in registry.GROUP_KINDS:
        section = data.get(kind)
        if isinstance(section, dict) and isinstance(section.get("name"), str):
            out[kind] = (section["name"], path)
    return out


def user_file_keys(recipe: str | None, path: Path | None = None, seen: tuple = ()) -> dict[str, Path]:
    """Each dotted key that a recipe file of the user's own sets (``recipe=``'s file and the files it extends,
    those outside apiary's recipes/), with the file that sets it last. A packaged recipe sets none."""
    path = path or recipe_path(recipe or DEFAULT_RECIPE)
    if path in seen or not path.is_file() or path.parent == RECIPES_DIR:
        return {}
    data = _read_yaml(path) or {}
    out: dict[str, Path] = {}
    for entry in data.get("defaults", []) or []:
        if isinstance(entry, str) and entry != "_self_":
            extended = path.parent / f"{entry}.yaml"
            if extended.is_file():
                out.update(user_file_keys(None, extended, (*seen, path)))

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            out[f"{prefix}{k}"] = path
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
    walk({k: v for k, v in data.items() if k != "defaults"}, "")
    return out


def shipped_values() -> dict[str, list]:
    """Each dotted key the packaged recipes (recipes/*.yaml) set, with the values they set it to."""
    out: dict[str, list] = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out.setdefault(f"{prefix}{k}", []).append(v)
    for p in sorted(RECIPES_DIR.glob("*.yaml")):
        walk({k: v for k, v in (_read_yaml(p) or {}).items() if k != "defaults"}, "")
    return out


def _option_of(key: str) -> list[str]:
    """``KIND=NAME`` for each name of a component group whose option declares the ``KIND.OPTION`` key (every
    owner, in the group's order), else []."""
    kind, _, leaf = key.partition(".")
    if kind not in registry.GROUP_KINDS or not leaf or "." in leaf:
        return []
    return [f"{kind}={name}" for name in registry.names(kind)
            if dataclasses.is_dataclass(opts := registry.options_of(kind, name))
            and leaf in {f.name for f in dataclasses.fields(opts)}]


def owner_hint(key: str, owners: list[str], setting: str) -> str:
    """``KEY is an option of A and B: write A SETTING or B SETTING.`` (every owner named)."""
    return (f"{key} is an option of {' and '.join(owners)}: write "
            f"{' or '.join(f'{o} {setting}' for o in owners)}.")


def _schema_keys() -> list[str]:
    """Every key a recipe may set: the schema's, and each component group's options (all its names)."""
    out: list[str] = []

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints.get(f.name)
            if dataclasses.is_dataclass(t):
                walk(t, f"{prefix}{f.name}.")
            else:
                out.append(f"{prefix}{f.name}")

    walk(RecipeConfig, "")
    for kind in registry.GROUP_KINDS:
        for name in registry.names(kind):
            opts = registry.options_of(kind, name)
            if opts is not None and dataclasses.is_dataclass(opts):
                out.extend(f"{kind}.{f.name}" for f in dataclasses.fields(opts))
    return list(dict.fromkeys(out))


def _unknown_key_in_file(path: Path, e: Exception) -> None:
    """A key in the recipe file (or a file it extends) that the schema lacks: name it with did-you-mean,
    as an override with that key would be."""
    msg = str(e)
    m = re.search(r"full_key: (\S+)", msg)
    if "ConfigKeyError" not in msg or m is None:
        return
    key = m.group(1)
    within = re.match(r"In '([^']+)'", msg)
    src = f" (set in {within.group(1)}.yaml)" if within and within.group(1) != path.stem else ""
    owners = _option_of(key)
    if owners:
        kind, name = owners[0].split("=")
        raise UserError(f"recipe {path}", f"sets {key!r}{src}, an option of {' and '.join(owners)}, and the recipe "
                        f"chooses another {kind}.", f"Choose {name} where the option is set: `{kind}: {{name: {name}, "
                        f"...}}` in that section, or `override /{kind}: {name}` in the `defaults:` list before _self_ "
                        f"(or {owners[0]} on the command line).") from None
    known = [k for k in _schema_keys() if k != key]
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = [k for k in known if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
    raise UserError(f"recipe {path}", f"sets {key!r}{src}, a key apiary does not have, so the setting would "
                    "be ignored.", did_you_mean(key, siblings) or did_you_mean(key, known)
                    or "`train --cfg job` lists the keys.") from None
