"""Recipe composition: recipe YAML (+ what it extends) + registry groups + CLI overrides
-> validated, typed config. Hydra's compose API does the composition and override grammar;
this module turns its failures into user errors that name the key and the closest valid ones.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework import contracts, registry
from framework.errors import UserError, closest, did_you_mean
from framework.schema import DEFAULT_RECIPE, RecipeConfig

RECIPES_DIR = registry.ROOT / "recipes"
_STORED: set = set()


def _store() -> None:
    """Register the schema and every group option (registry.yaml + user registries) with Hydra's ConfigStore."""
    cs = ConfigStore.instance()
    if not _STORED:
        cs.store(name="_schema", node=RecipeConfig)
        _STORED.add("_schema")
    for kind in registry.GROUP_KINDS:
        for name in registry.names(kind):
            if (kind, name) in _STORED:
                continue
            component = registry.resolve(kind, name, where=f"{kind}={name}")
            try:
                node = contracts.schema_of(component.Options)(name=name)
            except (AttributeError, TypeError):  # only a user's component can get here
                e = registry.entries()[kind][name]
                raise UserError(f"{kind}={name}", f"{e['target']} (from {e['source']}) needs an `Options` dataclass "
                                "with a `name: str` field, its keys with their defaults.",
                                "docs/architecture.md shows one (the worked example).") from None
            cs.store(group=kind, name=name, node=node)
            _STORED.add((kind, name))


def use_registries(path: Path, overrides: list[str]) -> None:
    """User registry files named by the recipe (`registry: PATH`, relative to it) or `registry=PATH`."""
    try:
        own = (yaml.safe_load(path.read_text()) or {}).get("registry")
    except (yaml.YAMLError, AttributeError):
        own = None  # composition reports a broken recipe
    if own:
        p = Path(own).expanduser()
        registry.use(p if p.is_absolute() else path.parent / p, where=f"registry: {own} in {path}")
    for o in overrides:
        key, sep, val = o.lstrip("+").partition("=")
        if key == "registry" and sep and val not in ("", "null"):
            registry.use(val, where=f"registry={val}")


def split_recipe(args: list[str]) -> tuple[str | None, list[str]]:
    """A command line's ``recipe=NAME`` (the last one given; None without one) and its other
    arguments, in order: how `train` and every `apiary` command that takes a recipe read it."""
    recipe, rest = None, []
    for a in args:
        key, sep, val = a.partition("=")
        if key == "recipe" and sep:
            recipe = val
        else:
            rest.append(a)
    return recipe, rest


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def recipe_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or "/" in name:
        if not p.is_file():
            other = p.with_suffix(".yaml" if p.suffix == ".yml" else ".yml") if p.suffix else p.with_suffix(".yaml")
            if other.is_file():
                raise UserError(f"recipe={name}", f"no recipe file at {p}. There is {other}: recipe={other}.",
                                "Copy one with `apiary cp NAME path`.")
            if (RECIPES_DIR / f"{p.stem}.yaml").is_file():  # recipe=debug_moe.yaml away from the checkout
                raise UserError(f"recipe={name}", f"no recipe file at {p} (a path is read from this folder, "
                                f"{Path.cwd()}); {p.stem} is a packaged recipe, which is named without a "
                                "path or suffix.", f"Write recipe={p.stem}, or copy it here to edit with "
                                f"`apiary cp {p.stem} {p.name}`.")
            raise UserError(f"recipe={name}", f"no recipe file at {p}.", "Copy one with `apiary cp NAME path`.")
        if p.suffix != ".yaml":
            raise UserError(f"recipe={name}", f"a recipe file is read by Hydra, which finds only files named *.yaml, "
                            f"and {p.name} ends in {p.suffix or 'no suffix'}.",
                            f"Rename it: mv {p} {p.with_suffix('.yaml')}, then recipe={p.with_suffix('.yaml')}.")
        return p.resolve()
    path = RECIPES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(
            f"recipe={name}",
            f"unknown recipe {name!r}; known recipes: {', '.join(recipe_names())}.",
            did_you_mean(name, recipe_names()) or "Run `apiary ls` to see them.",
        )
    return path


def _flat_keys(cfg, prefix: str = "") -> list[str]:
    out = []
    for k in cfg:
        path = f"{prefix}{k}"
        out.append(path)
        node = cfg[k]
        if isinstance(node, DictConfig):
            out.extend(_flat_keys(node, path + "."))
    return out


def _plain_keys(d: dict, prefix: str = "") -> list[str]:
    """Dotted keys of a plain (unresolved) container: nothing is resolved while listing them."""
    out = []
    for k, v in d.items():
        out.append(f"{prefix}{k}")
        if isinstance(v, dict):
            out.extend(_plain_keys(v, f"{prefix}{k}."))
    return out


def _compose(path: Path, overrides: list[str]) -> DictConfig:
    _store()
    GlobalHydra.instance().clear()
    searchpath = [f"file://{RECIPES_DIR}"]
    with initialize_config_dir(config_dir=str(path.parent), version_base=None):
        return compose(config_name=path.stem,
                       overrides=[f"hydra.searchpath=[{','.join(searchpath)}]", *overrides])


def load(recipe: str | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Compose a recipe with overrides into a typed DictConfig (schema: RecipeConfig)."""
    if recipe is not None and not str(recipe).strip():
        raise UserError("recipe=", "is empty: it names no recipe.",
                        f"Name one (known: {', '.join(recipe_names())}), or leave recipe= out for {DEFAULT_RECIPE}.")
    recipe = recipe or DEFAULT_RECIPE
    overrides = list(overrides or [])
    path = recipe_path(recipe)
    where = f"recipe {recipe}"
    _check_yaml(path)
    data = _check_recipe_file(path)
    use_registries(path, overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        check_ascii(overrides, where)
        _check_tilde(overrides)
        raise UserError(where, f"cannot parse the overrides: {e}".rstrip("."),
                        "Use key=value, group=option, ~key to unset.") from None
    group_overrides, value_overrides = [], []
    for raw, ov in zip(overrides, parsed):
        key = ov.key_or_group
        if ov.is_sweep_override():
            raise UserError(f"override {raw}", f"gives {key} several values (a comma list, range or choice is a "
                            "sweep: one job per value), and a run without -m is one job.",
                            f"Sweep with -m (train -m {raw}); or, for one value that holds a comma, quote it: "
                            f"'{key}=\"...\"' (a list: {key}=[a,b]).")
        if key in registry.GROUP_KINDS:
            if ov.is_add() or ov.is_force_add():
                plain = raw.lstrip("+")
                raise UserError(f"override {raw}", f"'+' adds a config group a recipe lacks, and every recipe already "
                                f"chooses a {key} (apiary's defaults do), so there is nothing to add.",
                                f"Choose the option without '+': {plain}.")
            if ov.is_delete():
                raise UserError(f"override {raw}", f"{key} is a component group every recipe needs; it cannot "
                                "be deleted.", f"Choose another option: {key}={'|'.join(registry.names(key))}.")
            name = ov.value()
            registry.check(key, str(name), where=f"{raw}")
            group_overrides.append(raw)
        else:
            value_overrides.append((raw, ov))
    group_overrides, extra = _file_group_choices(path, group_overrides)
    overrides = [*[g for g in group_overrides if g not in overrides], *overrides, *extra]
    try:
        base = _compose(path, group_overrides)
    except (HydraException, OmegaConfBaseException) as e:
        _unknown_key_in_file(path, e)
        if "defaults" not in data and group_overrides:
            raise _not_extending(path, data, f"and it has no component groups for {' '.join(group_overrides)} "
                                 "to choose from") from None
        raise UserError(where, f"does not compose: {_first_line(e)}.",
                        f"Check {path} and what it extends.") from None
    if OmegaConf.get_type(base) is not RecipeConfig:  # only a complete config (a run's config.yaml) stands alone
        try:
            OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(RecipeConfig), base), throw_on_missing=True)
        except OmegaConfBaseException as e:
            missing = getattr(e, "full_key", None) or _first_line(e)
            raise _not_extending(path, data, f"and it does not set {missing!r} itself, which every run needs") \
                from None
    known = _flat_keys(base)
    deletions = {}
    for raw, ov in value_overrides:
        key = ov.key_or_group
        if key.startswith("hydra"):
            if key.startswith("hydra.run.") or key == "hydra.run":
                raise UserError(f"override {raw}", "apiary does not use Hydra's run directory: a run writes "
                                "to output_dir.", f"Set output_dir={raw.partition('=')[2] or 'PATH'} instead "
                                "(a -m sweep: hydra.sweep.dir=PATH).")
            continue
        if (ov.is_add() or ov.is_force_add()) and key not in known:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            siblings = [k for k in known if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
            value = raw.partition("=")[2]
            owner = _option_of(key)
            hits = [h for h in closest(key, siblings) or closest(key, known) if h != key]
            if owner:
                hint = f"{key} is an option of {owner}: write {owner} {key}={value}."
            elif hits:
                hint = f"Did you mean {hits[0]!r}? Write {hits[0]}={value}."
            else:
                hint = "Run `train recipe=X --cfg job` to list the keys."
            raise UserError(f"override {raw}", f"adds a key {key!r} that recipe {recipe} does not have, and no "
                            "part of apiary reads a key it does not declare, so the setting would be ignored.", hint)
        if ov.is_add() or ov.is_force_add():
            continue  # '+key=v' on a key the recipe has: set it, as key=v (rewritten below)
        if key not in known:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            siblings = [k for k in known if k.rsplit(".", 1)[0] == parent] if parent in known else known
            hits = closest(key, siblings) or closest(key, known)
            hint = f"Closest valid keys: {', '.join(hits)}." if hits else "Run `train recipe=X --cfg job` to list the keys."
            owner = _option_of(key)  # an option of another name of the group: choose that name with it
            if owner:
                hint = f"{key} is an option of {owner}: write {owner} {raw}."
            raise UserError(f"override {raw}", f"unknown key {key!r} for recipe {recipe}.", hint)
        if ov.is_delete():
            deletions[raw] = _deletion(base, raw, ov)
    overrides = [deletions.get(o, o) for o in overrides]
    overrides = [o[1:] if o.startswith("+") and not o.startswith("++") and o[1:].partition("=")[0] in known else o
                 for o in overrides]
    try:
        cfg = _compose(path, overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(f"overrides {' '.join(overrides)}", f"{_first_line(e)}.",
                        "Check the value's type against `train recipe=X --cfg job`.") from None
    OmegaConf.set_struct(cfg, False)
    cfg.recipe = path.stem
    OmegaConf.set_struct(cfg, True)
    try:
        OmegaConf.to_container(cfg, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise UserError(where, f"a required value is missing: {_first_line(e)}.",
                        "Set it in the recipe or on the command line.") from None
    _check_interpolations(cfg)
    return cfg


def _check_interpolations(cfg: DictConfig) -> None:
    """Every ``${...}`` resolves (a missing key, a bad resolver): one paragraph naming the key, not
    OmegaConf's traceback at the first read of the value."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raw = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        reason = str(getattr(e, "msg", None) or e).strip().splitlines()[0].rstrip(".")
        missing = re.search(r"Interpolation key '([^']+)' not found", reason)
        hint = did_you_mean(missing.group(1), _plain_keys(OmegaConf.to_container(cfg, resolve=False))) \
            if missing else ""
        raise UserError(f"{key}={raw}" if isinstance(raw, str) else key,
                        f"the interpolation does not resolve: {reason}. An interpolation ${{KEY}} takes the value "
                        "of another key of the config.",
                        (hint + " " if hint else "") + "Name a key that exists (`train --cfg job` lists them), or "
                        "set a plain value.") from None


def _check_tilde(overrides: list[str]) -> None:
    """`key=~/x`: the shell expands `~` only at the start of a word, and Hydra's grammar has no unquoted
    `~` in a value: say so, not the parser's LexerNoViableAltException."""
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and value.startswith("~"):
            rest = value[2:] if value.startswith("~/") else "..."
            raise UserError(f"override {o}", "a value starting with ~ is not expanded: the shell expands ~ only at "
                            "the start of a word (not after key=), and Hydra's grammar does not take it unquoted.",
                            f"Write {key.lstrip('+')}=$HOME/{rest} (the shell expands $HOME), or quote it: "
                            f"{key.lstrip('+')}='{value}' (apiary expands a quoted ~/ in paths).")


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
    for entry in (data or {}).get("defaults", []) or []:
        if isinstance(entry, str) and entry != "_self_":
            extended = path.parent / f"{entry}.yaml"
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


def _not_extending(path: Path, data: dict, why: str) -> UserError:
    """A recipe that extends neither _defaults nor a recipe, and cannot stand alone (``why``)."""
    what = ("has no `defaults:` list" if "defaults" not in data else
            "has a `defaults:` list that reaches neither _defaults nor a recipe")
    return UserError(f"recipe {path}", f"{what}, so it does not extend apiary's defaults, {why}.", _EXTEND_HINT)


def _file_group_choices(path: Path, group_overrides: list[str]) -> tuple[list[str], list[str]]:
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


def _option_of(key: str) -> str:
    """``KIND=NAME`` for a ``KIND.OPTION`` key that an option of a component group declares (the first
    name that has it), else ''."""
    kind, _, leaf = key.partition(".")
    if kind not in registry.GROUP_KINDS or not leaf or "." in leaf:
        return ""
    for name in registry.names(kind):
        opts = getattr(registry.resolve(kind, name), "Options", None)
        if opts is not None and dataclasses.is_dataclass(opts) and leaf in {f.name for f in dataclasses.fields(opts)}:
            return f"{kind}={name}"
    return ""


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
            opts = getattr(registry.resolve(kind, name), "Options", None)
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
    owner = _option_of(key)
    if owner:
        kind, name = owner.split("=")
        raise UserError(f"recipe {path}", f"sets {key!r}{src}, an option of {owner}, and the recipe chooses another "
                        f"{kind}.", f"Choose {name} where the option is set: `{kind}: {{name: {name}, ...}}` in that "
                        f"section, or `override /{kind}: {name}` in the `defaults:` list before _self_ "
                        f"(or {owner} on the command line).") from None
    known = [k for k in _schema_keys() if k != key]
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = [k for k in known if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
    raise UserError(f"recipe {path}", f"sets {key!r}{src}, a key apiary does not have, so the setting would "
                    "be ignored.", did_you_mean(key, siblings) or did_you_mean(key, known)
                    or "`train --cfg job` lists the keys.") from None


def check_ascii(overrides: list[str], where: str) -> None:
    """Hydra's override grammar reads characters outside ASCII only in a quoted value: say so, with the
    override quoted (its lexer's own error gives no hint)."""
    for o in overrides:
        if not o.isascii():
            try:
                OverridesParser.create().parse_overrides([o])
                continue  # quoted already: another override is the one that does not parse
            except HydraException:
                pass
            key, _, val = o.partition("=")
            quoted = f"'{key}=\"{val}\"'" if '"' not in val else f'"{key}=\'{val}\'"'
            raise UserError(where, f"cannot parse the override {o}: Hydra's override grammar reads characters "
                            "outside ASCII only inside quotes.",
                            f"Quote the value, and the whole override for the shell: {quoted}.")


def _deletion(base: DictConfig, raw: str, ov) -> str:
    """`~key` unsets an optional key (back to null: derived or off); a required key is refused."""
    key = ov.key_or_group
    parent, _, leaf = key.rpartition(".")
    node = (OmegaConf.select(base, parent) if parent else base)._get_node(leaf)
    if isinstance(node, DictConfig) or not node._is_optional():
        raise UserError(f"override {raw}", f"{key} is a required setting (it may not be null), so it cannot be "
                        "deleted; `~` unsets optional keys (those whose default is null: derived or off).",
                        f"Set it instead: {key}=VALUE.")
    expected = ov.value()
    current = OmegaConf.select(base, key)
    if expected is not None and str(expected) != str(current):
        raise UserError(f"override {raw}", f"{key} is {current}, not {expected}; nothing deleted.",
                        f"Use ~{key} to unset it whatever its value.")
    return f"{key}=null"


def _first_line(e: Exception) -> str:
    msg = str(e).strip()
    if e.__cause__ is not None:
        msg = f"{msg}: {e.__cause__}"
    for prefix in ("Error merging override ", "Error merging "):
        msg = msg.replace(prefix, "")
    lines = [ln.strip() for ln in msg.splitlines()
             if ln.strip() and not ln.strip().startswith(("full_key", "object_type", "reference_type"))]
    return " ".join(lines[:3]).rstrip(".")
