"""The overrides a resume command repeats: what makes the run's recipe give its config again
(the end-of-run summary prints the command).
"""

from __future__ import annotations

import re

from framework.compose import recipes, registry
from framework.resolve import paths, resume

# keys a resume command sets itself, or that follow from the recipe
_NOT_REPEATED = ("output_dir", "training.steps", "checkpoint.resume", "checkpoint.load_step", "recipe", "description")


def _value(v) -> str:
    """A config value in Hydra's override grammar."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_value(x)}" for k, x in v.items()) + "}"
    s = str(v)
    return s if re.fullmatch(r"[\w./:@+-]+", s) else "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def run_overrides(cfg, recipe: str | None = None) -> list[str] | None:
    """The overrides that make the run's recipe give its config again (a resume must repeat what its
    checkpoint depends on, framework/resolve/resume.py): each component group whose option differs
    (``loss=NAME``), then every key that differs from that composition (``+key`` where the
    recipe has none); layout dims the recipe leaves unset are derived again. None when the recipe
    cannot be composed any more (moved or edited into an error). ``recipe``: the recipe as given at
    launch (a file's path), default the config's recipe name."""
    recipe = recipe or cfg.recipe
    try:
        extra = [f"registry={cfg.registry}"] if cfg.get("registry") else []
        base = recipes.load(recipe, extra)
        groups = [f"{g}={cfg[g].name}" for g in registry.GROUP_KINDS
                  if g in cfg and g in base and cfg[g].name != base[g].name]
        if groups:
            base = recipes.load(recipe, extra + groups)
        old, new = paths.absolute_leaves(resume.leaves(base)), resume.leaves(cfg)  # paths: as resolve stores them
    except Exception:  # noqa: BLE001  (a UserError, Hydra's or OmegaConf's: the summary still prints)
        return None
    out = extra + groups
    for key, v in new.items():
        if key in _NOT_REPEATED or key == "registry" or (key in old and old[key] == v):
            continue
        if key.startswith("parallel.") and key in old and old[key] is None:  # derived from the world size again
            continue
        v = paths.shown(v) if key in paths.KEYS and v is not None else v  # relative to this folder when under it
        out.append(f"{'' if key in old else '+'}{key}={_value(v)}")
    return out
