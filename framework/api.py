"""Python API: build a recipe's (or a flavor's) model on one process.

    from framework.api import build_model
    model = build_model("qwen35_debug_moe")                 # a recipe: its model section
    model = build_model("FAMILY:FLAVOR", n_layers=4)        # a model family's flavor (or a unique flavor)
    model = build_model("qwen35_debug_moe", hf_checkpoint="path/to/hf")   # HF weights
    logits = model(tokens)                                  # [B, S] token ids -> [B, S, V]

Generic over model families: the family module (registry.yaml kind ``model``) supplies
``model_spec`` (framework/contracts/protocols.py); this module only resolves names and materialises the model in fp32 on
this process's device.
"""

from __future__ import annotations

import inspect
import re

import torch

from framework import contracts, devices  # importing framework applies the device shims
from framework.compose import recipes, registry
from framework.errors import UserError, did_you_mean
from framework.resolve.context import model_kwargs


def _family_of_flavor(name: str) -> tuple[str, str]:
    if ":" in name:
        family, flavor = name.split(":", 1)
        registry.check("model", family, where=f"build_model({name!r})")
        return family, flavor
    hits = [f for f in registry.names("model") if name in contracts.member(registry.resolve("model", f), "model", "FLAVORS")]
    if len(hits) == 1:
        return hits[0], name
    known = recipes.recipe_names()
    if not hits:
        raise UserError(f"build_model({name!r})", "no recipe or model flavor of that name.",
                        did_you_mean(name, known) or "Pass a recipe name or FAMILY:FLAVOR.")
    raise UserError(f"build_model({name!r})", f"flavor {name!r} exists in several families: {', '.join(hits)}.",
                    f"Write it as FAMILY:FLAVOR, e.g. {hits[0]}:{name}.")


def model_settings(recipe_or_flavor: str, hf_checkpoint: str | None = None, **overrides) -> tuple[str, str, dict]:
    """(family, flavor, model_config kwargs) for a recipe or flavor name plus overrides."""
    kwargs: dict = {}
    if recipe_or_flavor in recipes.recipe_names() or recipe_or_flavor.endswith((".yaml", ".yml")):
        cfg = recipes.load(recipe_or_flavor, [])
        family, flavor = cfg.model.family, cfg.model.flavor
        kwargs = model_kwargs(cfg)
        if cfg.model.hf_checkpoint:
            kwargs["hf_checkpoint"] = cfg.model.hf_checkpoint
    else:
        family, flavor = _family_of_flavor(recipe_or_flavor)
    family = overrides.pop("family", family)
    flavor = overrides.pop("flavor", flavor)
    kwargs.update(overrides)
    if hf_checkpoint is not None:
        kwargs["hf_checkpoint"] = hf_checkpoint
    return family, flavor, kwargs


def _unknown_setting(recipe_or_flavor: str, family: str, mod, e: TypeError) -> UserError:
    """A setting the family's ``model_config`` does not take: name it and the family's settings, with a
    did-you-mean for a misspelling (``n_layer`` -> ``n_layers``)."""
    config_fn = contracts.member(mod, "model", "model_config")
    known = [n for n in inspect.signature(config_fn).parameters if n != "flavor"] if config_fn else []
    bad = re.search(r"unexpected keyword argument '(\w+)'", str(e))
    if bad is None or not known:
        return UserError(f"build_model({recipe_or_flavor!r})", f"{family}.model_spec does not take these settings: "
                         f"{e}.", "Drop the setting it names for this family.")
    takes = f"{family}'s model settings are {', '.join(known)} (and family=, flavor=)"
    return UserError(f"build_model({recipe_or_flavor!r}, {bad[1]}=...)", f"{family} has no model setting "
                     f"{bad[1]!r}: {takes}.", did_you_mean(bad[1], known) or f"Drop {bad[1]}=.")


def build_model(recipe_or_flavor: str, hf_checkpoint: str | None = None, *, device: str | None = None,
                **overrides) -> torch.nn.Module:
    """The model of a recipe or flavor: token ids [B, S] -> logits [B, S, V], fp32, one process.

    ``overrides`` are the family's ``model_config`` arguments (n_layers, vocab_size,
    attn_backend, ...) and may replace ``family`` / ``flavor``. ``hf_checkpoint`` loads a
    HuggingFace folder after the random init (families that support it).
    """
    family, flavor, kwargs = model_settings(recipe_or_flavor, hf_checkpoint, **overrides)
    mod = registry.resolve("model", family, where=f"model.family={family}")
    flavors = list(contracts.member(mod, "model", "FLAVORS"))
    if flavor not in flavors:
        raise UserError(f"model.flavor={flavor}", f"unknown flavor for {family}; known: {', '.join(flavors)}.",
                        did_you_mean(flavor, flavors))
    try:
        config = mod.model_spec(flavor, **kwargs).model
    except TypeError as e:
        raise _unknown_setting(recipe_or_flavor, family, mod, e) from None
    dev = torch.device(device or devices.device_type())
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=dev)
    with torch.no_grad():
        model.init_states(buffer_device=dev)
    return model
