"""The registry kinds: their names, the order build applies them in, where each kind's choice lives in
the recipe, and the ``Context`` a component sees.
"""

from __future__ import annotations

import json
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


@dataclass(slots=True)
class Shared:
    """What one component's check leaves for another kind's check or apply (``ctx.shared``), one
    declared field each (an undeclared one is refused: the class has slots). The plain-data fields go
    to the ranks with the resolved run (framework/resolve/handoff.py); objects serve the checks only."""

    load_path_reader: str | None = None
    """a component that loads ``checkpoint.load_path`` itself, resumed or not (an adapter's frozen base),
    in words; resolve then leaves the path to it (framework/resolve/outputs.py, needs.py)"""
    adapter_base: dict | None = None
    """an adapter's frozen base: its identity (as the adapter's check states it), which the adapter's
    apply records in the adapters' checkpoint"""
    text_source: Any = None
    """data.format=text: the text source's summary object (its ``tokens()``), for the data's own check
    that one step's tokens exist"""
    records_with_ref: bool | None = None
    """RL records (a data format's check): whether they carry reference log-probs (None: not known before
    launch); a policy loss with a KL term refuses False"""
    records_path: str | None = None
    """RL records (a data format's check): where they are read from (data.path, or the packaged ones), which a
    policy loss's refusal names"""

    def plain(self) -> dict:
        """The fields that are plain data (JSON), by name: what resolved.yaml keeps."""
        out = {}
        for name in self.__slots__:
            try:
                json.dumps(getattr(self, name))
            except (TypeError, ValueError):
                continue
            out[name] = getattr(self, name)
        return out


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
    shared: Shared = field(default_factory=Shared)  # facts one component's check leaves for another's
    plan: Any = None  # a PlanContext while the planner asks plan_terms, else None
    # kind -> what resolve chose for a component that plans by memory budget (PlanTerms
    # ``facts.candidates``, e.g. recompute=auto): the chosen candidate's facts and the reason
    derived: dict = field(default_factory=dict)

    def choice(self, kind: str) -> str:
        """The name chosen for ``kind`` (the value of its key in the recipe)."""
        section, key = SELECT[kind]
        return str(self.cfg[section][key])
