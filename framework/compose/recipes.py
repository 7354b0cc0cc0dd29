"""Recipe composition: recipe YAML (+ what it extends) + registry groups + CLI overrides
-> validated, typed config. Hydra's compose API does the composition and override grammar;
this module turns its failures into user errors that name the key and the closest valid ones.

The recipe file itself (where a name's file is, its YAML, what it extends, its group choices):
recipe_files.py.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework import contracts
from framework.compose import recipe_files, registry
from framework.compose.messages import first_line as _first_line
from framework.compose.messages import list_expected, wrong_type
from framework.compose.recipe_files import (
    RECIPES_DIR,
    _not_extending,
    _option_of,
    _unknown_key_in_file,
    file_group_choices,
    owner_hint,
    recipe_names,
    recipe_path,
)
from framework.compose.schema import DEFAULT_RECIPE, RecipeConfig
from framework.errors import UserError, closest, did_you_mean

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
    """A command line's ``recipe=NAME`` (given once, or twice alike; None without one) and its other
    arguments, in order: how `train` and every `apiary` command that takes a recipe read it."""
    recipe, rest = None, []
    for a in args:
        key, sep, val = a.partition("=")
        if key == "recipe" and sep:
            if recipe not in (None, val):  # was: the last one won, without a word
                raise UserError("recipe=", f"is given twice, as recipe={recipe} and as recipe={val}.",
                                "Give recipe= once, with the recipe meant.")
            recipe = val
        else:
            rest.append(a)
    return recipe, rest


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
    """Hydra's compose of the recipe file; a defaults list without ``_self_`` composes it last, as apiary's
    recipes write it, so Hydra's warning about that (its file and line in site-packages) is not shown."""
    _store()
    GlobalHydra.instance().clear()
    searchpath = [f"file://{RECIPES_DIR}"]
    with initialize_config_dir(config_dir=str(path.parent), version_base=None), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"In '.*': Defaults list is missing `_self_`", category=UserWarning)
        return compose(config_name=path.stem,
                       overrides=[f"hydra.searchpath=[{','.join(searchpath)}]", *overrides])


def load(recipe: str | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Compose a recipe with overrides into a typed DictConfig (schema: RecipeConfig): the recipe's file
    and the user registries it names, the overrides parsed with each group choice checked, the recipe
    composed with its group choices, each value override checked against the keys that gives, then all
    composed."""
    recipe, path, data = _recipe_file(recipe)
    overrides = list(overrides or [])
    use_registries(path, overrides)
    group_overrides, value_overrides, overrides = _parsed(path, overrides, f"recipe {recipe}")
    base = _composed_groups(path, data, group_overrides, f"recipe {recipe}")
    overrides = _checked_values(base, value_overrides, overrides, recipe)
    return _composed(path, overrides, recipe)


def _recipe_file(recipe: str | None) -> tuple[str, Path, dict]:
    """The recipe's name (the default for None), its file and its YAML (checked: recipe_files.read)."""
    if recipe is not None and not str(recipe).strip():
        raise UserError("recipe=", "is empty: it names no recipe.",
                        f"Name one (known: {', '.join(recipe_names())}), or leave recipe= out for {DEFAULT_RECIPE}.")
    recipe = recipe or DEFAULT_RECIPE
    path = recipe_path(recipe)
    return recipe, path, recipe_files.read(path)  # its YAML, what it extends, not empty


def _parsed(path: Path, overrides: list[str], where: str) -> tuple[list[str], list, list[str]]:
    """The overrides in Hydra's grammar, split into group choices (each checked against the registry, the
    recipe file's own added: recipe_files.file_group_choices) and value overrides ``(raw, parsed)``; and
    the overrides with those group choices first."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        check_ascii(overrides, where)
        _check_tilde(overrides)
        check_bare_words(overrides)
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
    group_overrides, extra = file_group_choices(path, group_overrides)
    return group_overrides, value_overrides, [*[g for g in group_overrides if g not in overrides], *overrides, *extra]


def _composed_groups(path: Path, data: dict, group_overrides: list[str], where: str) -> DictConfig:
    """The recipe composed with its group choices alone (the keys a value override may name); a recipe
    that does not compose, or is not complete without extending apiary's defaults, said so."""
    try:
        base = _compose(path, group_overrides)
    except (HydraException, OmegaConfBaseException) as e:
        _unknown_key_in_file(path, e)
        if "defaults" not in data and group_overrides:
            raise _not_extending(path, data, f"and it has no component groups for {' '.join(group_overrides)} "
                                 "to choose from") from None
        missing = re.search(r"Could not find '([\w.-]+)/([^']+)'", str(e))  # `override /loss: chunkd`
        if missing and missing[1] in registry.entries():  # every name, and a did-you-mean, as on the command line
            registry.check(missing[1], missing[2], where=f"{where}: override /{missing[1]}: {missing[2]} in {path}")
        key = _full_key(e)  # the key a wrong value sits at (`steps: five`), which the message leaves out
        said = list_expected(e, key, data) or _first_line(e)
        raise UserError(where, f"does not compose: {f'{key}: ' if key else ''}{said}.",
                        f"Check {f'{key} in ' if key else ''}{path} and what it extends.") from None
    if OmegaConf.get_type(base) is not RecipeConfig:  # only a complete config (a run's config.yaml) stands alone
        try:
            OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(RecipeConfig), base), throw_on_missing=True)
        except OmegaConfBaseException as e:
            missing = getattr(e, "full_key", None) or _first_line(e)
            raise _not_extending(path, data, f"and it does not set {missing!r} itself, which every run needs") \
                from None
    return base


def _checked_values(base: DictConfig, value_overrides: list, overrides: list[str], recipe: str) -> list[str]:
    """Each value override against the keys ``base`` has (an unknown key, a '+' adding one no part of
    apiary reads, Hydra's run directory refused); returns ``overrides`` with ``~key`` as ``key=null`` and
    '+key=v' on a key the recipe has as ``key=v``."""
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
            owners = _option_of(key)
            hits = [h for h in closest(key, siblings) or closest(key, known) if h != key]
            if owners:
                hint = owner_hint(key, owners, f"{key}={value}")
            elif hits:
                hint = f"Did you mean {hits[0]!r}? Write {hits[0]}={value}."
            else:
                hint = f"Run `train recipe={recipe} --cfg job` to list the keys."
            raise UserError(f"override {raw}", f"adds a key {key!r} that recipe {recipe} does not have, and no "
                            "part of apiary reads a key it does not declare, so the setting would be ignored.", hint)
        if ov.is_add() or ov.is_force_add():
            continue  # '+key=v' on a key the recipe has: set it, as key=v (rewritten below)
        if key not in known:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            siblings = [k for k in known if k.rsplit(".", 1)[0] == parent] if parent in known else known
            hits = closest(key, siblings) or closest(key, known)
            hint = f"Closest valid keys: {', '.join(hits)}." if hits else \
                f"Run `train recipe={recipe} --cfg job` to list the keys."
            owners = _option_of(key)  # an option of other names of the group: choose one of them with it
            if owners:
                hint = owner_hint(key, owners, raw)
            raise UserError(f"override {raw}", f"unknown key {key!r} for recipe {recipe}.", hint)
        if ov.is_delete():
            deletions[raw] = _deletion(base, raw, ov)
    overrides = [deletions.get(o, o) for o in overrides]
    overrides = [o[1:] if o.startswith("+") and not o.startswith("++") and o[1:].partition("=")[0] in known else o
                 for o in overrides]
    return overrides


def _composed(path: Path, overrides: list[str], recipe: str) -> DictConfig:
    """The recipe composed with every override; a value its key's type cannot hold, a required value
    missing or an interpolation that does not resolve said so."""
    where = f"recipe {recipe}"
    try:
        cfg = _compose(path, overrides)
    except (HydraException, OmegaConfBaseException) as e:
        hint = f"Check the value's type against `train recipe={recipe} --cfg job`."
        raise wrong_type(e, overrides) or UserError(f"overrides {' '.join(overrides)}", f"{_first_line(e)}.", hint) from None
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


def check_bare_words(args: list[str]) -> None:
    """`train debug_moe`, `apiary plan qwen35_35b_128k`, `train OPTION`: a word without `=` is no override
    (`apiary show NAME` takes a bare name, these do not); a recipe's name or file, or a component option,
    is named with the spelling meant instead of the parser's "missing EQUAL"."""
    for a in args:
        if "=" in a or a.startswith(("~", "-")):
            continue
        if a in recipe_names() or (a.endswith((".yaml", ".yml")) and Path(a).is_file()):
            raise UserError(a, "is a recipe given without recipe= (a word without '=' is not an override).",
                            f"Write recipe={a}.")
        groups = [f"{k}={a}" for k in registry.GROUP_KINDS if a in registry.names(k)]
        if groups:
            raise UserError(a, "is a component option given without its group (a word without '=' is not an "
                            "override).", f"Write {' or '.join(groups)}.")


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


def _full_key(e: BaseException | None) -> str:
    """The dotted key an OmegaConf error names (its ``full_key``), through the causes Hydra wraps it in."""
    seen = 0
    while e is not None and seen < 5:
        key = getattr(e, "full_key", None) if isinstance(e, OmegaConfBaseException) else None
        if key:
            return str(key)
        e, seen = e.__cause__ or e.__context__, seen + 1
    return ""
