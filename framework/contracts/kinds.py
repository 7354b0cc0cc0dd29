"""The registry kinds: their names, the order build applies them in, where each kind's choice lives in
the recipe, and the ``Context`` a component sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# The registry kinds, in the order build applies them to the Trainer.Config.
KINDS = ("model", "adapter", "precision", "moe_comm", "moe_chunk", "data", "loss", "recompute", "state", "launcher",
         "transport")


# The order is part of the contract: model sets the model spec; adapter, precision and moe_chunk then
# convert it in this order, each reading the spec (and chaining the post-optimizer hook) the one before
# left; data sets the batch keys the loss reads; state comes last because it wraps the spec's
# parallelize function (inside which recompute's activation checkpointing is applied) and replaces the
# optimizer configuration the others filled in.
APPLY_ORDER = ("model", "adapter", "precision", "moe_comm", "moe_chunk", "data", "loss", "recompute", "state")


# Where each kind's choice and options live in the recipe: kind -> (section, key naming the choice).
# Group kinds (``loss=NAME``) keep their options in their own section; the others share a
# framework section (``model.family``, ``moe.comm``, ``data.format``).
SELECT = {"model": ("model", "family"), "adapter": ("adapter", "name"), "precision": ("precision", "name"),
          "moe_comm": ("moe", "comm"),
          "moe_chunk": ("moe", "chunk"), "data": ("data", "format"), "loss": ("loss", "name"),
          "recompute": ("recompute", "name"), "state": ("state", "name"), "launcher": ("launcher", "name"),
          "transport": ("publish", "transport")}
GROUP_KINDS = tuple(k for k in KINDS if SELECT[k] == (k, "name"))


# apiary compare's tolerance kinds (toolkit.compare documents each).
Tolerance = Literal["exact", "dp", "fp32", "bf16", "dtype", "fp8", "any"]


@dataclass
class Context:
    """What a component sees at check / apply / plan time (read-only by convention)."""

    cfg: Any  # the composed recipe (DictConfig)
    facts: Any = None  # the model's facts (ModelFamily.facts: sizes, experts, heads) once known
    layout: Any = None  # framework.resolve.layout.Layout once derived
    for_training: bool = True  # False for print-only commands (--cfg, plan, show)
    components: dict = field(default_factory=dict)  # kind -> the chosen component (registry object)
    options: dict = field(default_factory=dict)  # kind -> its Options instance
    summary: list = field(default_factory=list)  # lines rank 0 prints first (what the run trains on)
    shared: dict = field(default_factory=dict)  # facts one component's check leaves for another's
    plan: Any = None  # a PlanContext while the planner asks plan_terms, else None
    # kind -> what resolve chose for a component that plans by memory budget (PlanTerms
    # ``facts["candidates"]``, e.g. recompute=auto): the chosen candidate's facts and the reason
    derived: dict = field(default_factory=dict)

    def choice(self, kind: str) -> str:
        """The name chosen for ``kind`` (the value of its key in the recipe)."""
        section, key = SELECT[kind]
        return str(self.cfg[section][key])
