"""Which members each kind declares (required, or optional with a default) and how the framework
reads one (``member``).
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Mapping, Protocol

from framework.contracts.kinds import Tolerance
from framework.contracts.protocols import (
    Adapter,
    Data,
    Launcher,
    Loss,
    LossFn,
    ModelFamily,
    MoeChunk,
    MoeComm,
    Precision,
    Recompute,
    State,
    Transport,
)

PROTOCOLS: dict[str, type] = {
    "model": ModelFamily, "adapter": Adapter, "loss": Loss, "recompute": Recompute, "state": State, "moe_comm": MoeComm,
    "moe_chunk": MoeChunk, "precision": Precision, "data": Data, "launcher": Launcher, "transport": Transport,
}


# Contracts that are not registry kinds but whose members the framework reads the same way.
RUNTIME_PROTOCOLS: dict[str, type] = {"loss_fn": LossFn}

_NO_NUMERICS: Mapping[str, Tolerance] = MappingProxyType({})


# Members every kind may leave out: NUMERICS (apiary compare then holds a switch to nothing, the
# tolerance "any"), SKILL (the skill page is <name>.md, else the kind's).
_SHARED_OPTIONAL: dict[str, Any] = {"NUMERICS": _NO_NUMERICS, "SKILL": None}


# The planner's share: without plan_terms the planner counts nothing for the component and warns.
_PLANNED_OPTIONAL: dict[str, Any] = {"plan_terms": None, "PLAN_CONSTANTS": MappingProxyType({})}


# kind -> optional member -> the default a component that leaves it out gets from ``member``. Every
# other member of the kind's Protocol is required (resolve refuses a component without it). A
# default of None for a function means "not offered": the caller skips that step or refuses.
OPTIONAL_MEMBERS: dict[str, dict[str, Any]] = {
    "model": {**_SHARED_OPTIONAL,
              "hf_writer": None,  # no weight publication (resolve refuses publish.interval > 0)
              "HF_MODEL_TYPES": (),  # reads no HF config.json (show, logprobs skip the family)
              "LONG_CONTEXT_FLAVORS": MappingProxyType({}),  # no longer-context flavor to suggest
              "export_hf": None,  # `apiary export` refuses the family
              "model_config": None, "arch_from_config": None, "arch_of": None, "hf_config": None,
              "STATE_DICT_ADAPTER": None,  # the generic HF helpers need these four (qwen3, llama3)
              "hf_key_shapes": None,  # checkpoint keys are the adapter's own names and shapes
              "save_hf": None,  # the generic writer (hf_export.save) writes the family's folder
              "PLAN_CONSTANTS": MappingProxyType({})},  # its layer kinds plan with no calibrated constant
    "adapter": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL,
                "export_hf": None,  # `apiary export` of a run with this adapter is refused
                "published_form": None},  # publication writes the model family's whole folder
    "precision": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL},
    "moe_comm": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL},
    "moe_chunk": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL},
    "data": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL,  # without plan_terms: documents as long as a row
             "ignored_keys": None},  # reads every data.* key it is given
    "loss": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL, "NEEDS_DATA": None, "RL_KEYS": (), "POLICY_OBJECTIVE": False},
    "recompute": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL,
                  "memory_budget": None},  # does not plan by memory budget: resolve chooses nothing
    "state": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL,
              "layout": None},  # runs the degrees layout.derive chose
    "launcher": {**_SHARED_OPTIONAL, "check_options": None, "preflight": None, "render": None, "TEMPLATE": None},
    "transport": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL},
    "loss_fn": {"set_batch": None, "metrics": MappingProxyType({}), "metric_weight": None},
}


class UndeclaredMember(LookupError):
    """``member`` was asked for a name the kind's contract does not declare (a framework bug, or a
    member to add to the Protocol and, when optional, to ``OPTIONAL_MEMBERS``)."""


@functools.lru_cache(maxsize=None)
def declared_members(kind: str) -> dict[str, bool]:
    """Every member of ``kind``'s contract (required and optional): name -> whether it is a function
    (False: a value: a constant, a mapping, a class such as ``Options``)."""
    proto = PROTOCOLS.get(kind) or RUNTIME_PROTOCOLS[kind]
    out: dict[str, bool] = {}
    for klass in reversed(proto.__mro__):
        if klass in (object, Protocol) or not getattr(klass, "_is_protocol", False):
            continue
        out.update({n: False for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")})
        out.update({n: True for n, v in vars(klass).items() if callable(v) and not n.startswith("_")
                    and not isinstance(v, type)})
    return out


def required_members(kind: str) -> list[str]:
    """The members of ``kind``'s contract a component must have (no default)."""
    return sorted(n for n in declared_members(kind) if n not in OPTIONAL_MEMBERS[kind])


def missing_members(kind: str, obj: Any) -> list[str]:
    """The required members of ``kind``'s contract that ``obj`` lacks (resolve, the registry test)."""
    return [n for n in required_members(kind) if not hasattr(obj, n)]


def member(component: Any, kind: str, name: str) -> Any:
    """``component``'s member ``name`` under ``kind``'s contract: its own, else the default
    ``OPTIONAL_MEMBERS`` declares (an optional member it leaves out). ``UndeclaredMember`` for a name
    the contract does not declare; AttributeError for a required member the component lacks."""
    if name not in declared_members(kind):
        raise UndeclaredMember(f"{name!r} is not a member of the {kind} contract (framework/contracts/protocols.py "
                               f"declares {', '.join(sorted(declared_members(kind)))}); declare it in the "
                               f"Protocol, and its default in OPTIONAL_MEMBERS[{kind!r}] when optional.")
    optional = OPTIONAL_MEMBERS[kind]
    if name in optional:
        return getattr(component, name, optional[name])
    return getattr(component, name)
