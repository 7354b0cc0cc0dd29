"""Recipe composition: recipe YAML (+ what it extends) + registry groups + CLI overrides
-> validated, typed config. Hydra's compose API does the composition and override grammar;
this module turns its failures into user errors that name the key and the closest valid ones.
"""

from __future__ import annotations

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
from framework.schema import RecipeConfig

RECIPES_DIR = registry.ROOT / "recipes"
DEFAULT_RECIPE = "debug_moe"
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


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def recipe_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or "/" in name:
        if not p.is_file():
            raise UserError(f"recipe={name}", f"no recipe file at {p}.", "Copy one with `apiary cp NAME path`.")
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
    use_registries(path, overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise UserError(where, f"cannot parse the overrides: {e}".rstrip("."),
                        "Use key=value, group=option, +key=value to add, ~key to delete.") from None
    group_overrides, value_overrides = [], []
    for raw, ov in zip(overrides, parsed):
        key = ov.key_or_group
        if key in registry.GROUP_KINDS:
            if ov.is_delete():
                raise UserError(f"override {raw}", f"{key} is a component group every recipe needs; it cannot "
                                "be deleted.", f"Choose another option: {key}={'|'.join(registry.names(key))}.")
            name = ov.value()
            registry.check(key, str(name), where=f"{raw}")
            group_overrides.append(raw)
        else:
            value_overrides.append((raw, ov))
    _check_yaml(path)
    try:
        base = _compose(path, group_overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(where, f"does not compose: {_first_line(e)}.",
                        f"Check {path} and what it extends.") from None
    known = _flat_keys(base)
    deletions = {}
    for raw, ov in value_overrides:
        key = ov.key_or_group
        if key.startswith("hydra"):
            continue
        if (ov.is_add() or ov.is_force_add()) and key not in known:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            siblings = [k for k in known if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
            hint = did_you_mean(key, siblings) or did_you_mean(key, known)
            raise UserError(f"override {raw}", f"adds a key {key!r} that recipe {recipe} does not have, and no "
                            "part of apiary reads a key it does not declare, so the setting would be ignored.",
                            (f"{hint} Set it without '+'." if hint else
                             "Run `train recipe=X --cfg job` to list the keys."))
        if ov.is_add() and key in known:  # Hydra's rule: '+' adds a key that is not there
            raise UserError(f"override {raw}", f"'+' adds a key, and recipe {recipe} already has {key!r}.",
                            f"Set it without '+': {raw[1:]} (or '++' to add-or-override).")
        if ov.is_add() or ov.is_force_add():
            continue
        if key not in known:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            siblings = [k for k in known if k.rsplit(".", 1)[0] == parent] if parent in known else known
            hits = closest(key, siblings) or closest(key, known)
            hint = f"Closest valid keys: {', '.join(hits)}." if hits else "Run `train recipe=X --cfg job` to list the keys."
            raise UserError(f"override {raw}", f"unknown key {key!r} for recipe {recipe}.", hint)
        if ov.is_delete():
            deletions[raw] = _deletion(base, raw, ov)
    overrides = [deletions.get(o, o) for o in overrides]
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
    return cfg


def _check_yaml(path: Path, seen: set | None = None) -> None:
    """A recipe (and each recipe it extends) must parse as YAML: say file:line, not a traceback."""
    seen = set() if seen is None else seen
    if path in seen or not path.is_file():
        return
    seen.add(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise UserError(f"recipe {at}", f"is not valid YAML: {what}.",
                        "Fix the line (indentation, a missing ':' or closing bracket), then rerun.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"recipe {path}", f"cannot be read: {e}.") from None
    if data is not None and not isinstance(data, dict):
        raise UserError(f"recipe {path}", f"must be a YAML mapping of keys to values, not a {type(data).__name__}.",
                        "Start from a copy: `apiary cp debug_moe my_recipe.yaml`.")
    for entry in (data or {}).get("defaults", []) or []:
        if isinstance(entry, str) and entry != "_self_":
            extended = path.parent / f"{entry}.yaml"
            _check_yaml(extended if extended.is_file() else RECIPES_DIR / f"{entry}.yaml", seen)


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
