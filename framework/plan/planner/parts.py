"""The planner's view of the registry: the chosen component of each kind and its ``plan_terms``.

The planner knows no component: it asks ``framework.compose.registry`` for the object bound to a name and
calls its ``plan_terms(options, ctx)``. A name that is not registered, or whose component has no
``plan_terms``, is planned as the recipe defaults' choice of that kind, with a warning.
"""

from __future__ import annotations

from functools import lru_cache

import yaml
from omegaconf import OmegaConf

from framework import contracts
from framework.compose import registry, schema
from framework.contracts import SELECT, PlanTerms

DEFAULTS_PATH = registry.ROOT / "recipes" / "_defaults.yaml"


@lru_cache(maxsize=None)
def defaults() -> dict[str, str]:
    """kind -> the name recipes/_defaults.yaml chooses (the stand-in for a name the planner cannot plan)."""
    data = yaml.safe_load(DEFAULTS_PATH.read_text()) or {}
    out = {}
    for item in data.get("defaults", []):
        if isinstance(item, dict):
            out.update({str(k): str(v) for k, v in item.items()})
    recipe = OmegaConf.structured(schema.RecipeConfig)  # the other kinds' defaults live in the schema
    for kind, (section, key) in SELECT.items():
        if kind not in out and OmegaConf.select(recipe, f"{section}.{key}", default=None) is not None:
            out[kind] = str(OmegaConf.select(recipe, f"{section}.{key}"))
    return out


def component(kind: str, name: str):
    """The registered object of ``kind``/``name`` when it has ``plan_terms``, else None."""
    if name not in registry.entries().get(kind, {}):
        return None
    obj = registry.resolve(kind, name)
    return obj if contracts.member(obj, kind, "plan_terms") is not None else None


def names(kind: str) -> list[str]:
    """Every registered name of ``kind`` whose component has ``plan_terms``, in registry order."""
    return [n for n in registry.names(kind) if component(kind, n) is not None]


def options(cfg, kind: str, name: str):
    """The recipe's options of ``kind`` when it chose ``name``, else None (the component's defaults)."""
    node = cfg.get(kind) if hasattr(cfg, "get") else None
    return node if node is not None and str(getattr(node, "name", "")) == name else None


def ask(kind: str, name: str, ctx, warnings: list[str]) -> tuple[str, PlanTerms]:
    """(the name planned, its PlanTerms): ``name``'s own, or the default's with a warning."""
    obj = component(kind, name)
    if obj is not None:
        return name, obj.plan_terms(options(ctx.cfg, kind, name), ctx)
    base = defaults()[kind]
    terms = component(kind, base).plan_terms(None, ctx)
    summary = terms.facts.summary
    warnings.append(f"{kind} {name!r} is unknown to the planner; estimated as {base}"
                    + (f" ({summary})." if summary else "."))
    return base, terms

