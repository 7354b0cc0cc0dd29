"""The component contracts: what each registry kind provides, checked before launch.

registry.yaml binds ``kind -> name -> module:attr``; the object it names satisfies the Protocol
of its kind below. The framework talks to components only through these members, so it never
names a component module or option. Components import from ``framework`` only this module,
``framework.errors`` and ``framework.devices`` (the device shims that must run before torchtitan
is imported).

Every kind shares the same life cycle:

1. ``Options``: a kw_only dataclass in torchtitan's style (a docstring per field, ``Literal``
   choices, value checks in ``__post_init__`` raising ``ValueError``). The recipe's group
   (``loss:``, ``state:``, ...) is validated against it by OmegaConf; its defaults are the only
   defaults of those keys.
2. ``check(options, ctx)``: called by ``framework.resolve`` before any worker starts, with the
   composed recipe, the model facts and the derived layout. Raises ``ValueError`` (the reason;
   resolve turns it into a one-paragraph ``UserError`` naming the key) or ``UserError``.
3. ``apply(options, tc, ctx)``: called by ``framework.build`` in the order of ``APPLY_ORDER``; edits
   torchtitan's ``Trainer.Config`` ``tc`` in place (its model spec, loss, activation checkpoint,
   parallelism, optimizer, dataloader, tokenizer, ...).
4. ``plan_terms(options, ctx)``: what the component adds to the planner's estimate (memory terms,
   step-time factors), see ``PlanTerms``.
5. ``NUMERICS``: how ``apiary compare`` holds two runs that differ in this component or in one of
   its options to each other (``""``: another name of the same kind; ``"opt"``: that option).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping, Protocol, runtime_checkable

# The registry kinds, in the order build applies them to the Trainer.Config.
KINDS = ("model", "precision", "moe_comm", "moe_chunk", "data", "loss", "recompute", "state", "launcher")
APPLY_ORDER = ("model", "precision", "moe_chunk", "data", "loss", "recompute", "state")

# apiary compare's tolerance kinds (toolkit.compare documents each).
Tolerance = Literal["exact", "dp", "fp32", "bf16", "dtype", "fp8", "any"]


@dataclass
class Context:
    """What a component sees at check / apply / plan time (read-only by convention)."""

    cfg: Any  # the composed recipe (DictConfig)
    facts: Any = None  # the model's facts (components.models.common.ModelFacts) once known
    layout: Any = None  # framework.layout.Layout once derived
    for_training: bool = True  # False for print-only commands (--cfg, plan, show)
    plan: Any = None  # a PlanContext while the planner asks plan_terms, else None


@dataclass
class Term:
    """One line of the planner's per-GPU memory estimate: ``count x bytes_per`` bytes."""

    name: str
    count: float
    bytes_per: float
    category: Literal["static", "activations", "buffers", "loss"]
    how: str  # how count and bytes were derived, printed by `apiary plan --explain`

    @property
    def bytes(self) -> float:
        return self.count * self.bytes_per


@dataclass
class PlanTerms:
    """A component's share of the planner's estimate (every field optional)."""

    memory: list[Term] = field(default_factory=list)
    # multiplies the time of a compute part ("lm_head", "dense", "experts", "attention", ...)
    time_factor: dict[str, float] = field(default_factory=dict)
    # extra forward FLOPs as a fraction of a part's fwd+bwd FLOPs (recompute)
    extra_compute: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed as assumptions
    # kind-specific numbers the planner reads: loss "objective" (--search varies the loss among
    # those with the recipe's objective), "summary"; recompute "keep" (layer kind -> fraction of
    # saved activations kept), "inputs_only", "forward_reruns"; state "comm" {name: seconds},
    # "overlap" {name: fraction}, "label"; moe_chunk "chunks", "overlap"; precision its FP8 shares
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class PlanContext:
    """What the planner adds to ``Context`` (``ctx.plan``) when it asks ``plan_terms``: its
    calibrated constants, the GPU and the shapes of the pipeline stage it is estimating.

    ``plan_terms(options, ctx)`` gets ``options=None`` when the planner asks about a name the
    recipe did not choose (``plan(loss=...)``, ``--search``): the component plans its defaults."""

    constants: Any  # framework.planner.Constants, calibrated; components read their own constants by name
    hw: Any  # framework.planner.Hardware of the planned GPU
    tokens: float  # local tokens per microbatch on one rank (micro_batch x seq_len / cp, before TP)
    micro_batch: int  # sequences per microbatch
    split: dict  # parameters of the whole model: emb, head (+ final norm), dense_blocks, experts
    counts: dict  # layers of each kind on one stage (attention, linear_attention, moe, mlp, norms)
    grad_accum: int = 1  # gradient-accumulation micro-steps per optimizer step
    first: bool = True  # the stage holds the embedding
    last: bool = True  # the stage holds the LM head (and the loss)
    earlier: dict = field(default_factory=dict)  # kind -> PlanTerms of the kinds planned before this one
    link_bw: Any = None  # link_bw(group, stride) -> bytes/s of a collective over group ranks stride apart


@runtime_checkable
class Component(Protocol):
    """Members every kind shares (see the module docstring)."""

    Options: ClassVar[type]
    NUMERICS: ClassVar[Mapping[str, Tolerance]]

    def check(self, options: Any, ctx: Context) -> None: ...

    def apply(self, options: Any, tc: Any, ctx: Context) -> None: ...

    def plan_terms(self, options: Any, ctx: Context) -> PlanTerms: ...


class ModelFamily(Component, Protocol):
    """kind ``model``: a family module. ``FLAVORS`` names its sizes; ``facts`` sizes a flavor
    without building it; ``apply`` puts the model spec on ``tc``."""

    FLAVORS: Mapping[str, Any]

    def facts(self, flavor: str, **model_kwargs: Any) -> Any: ...

    def model_spec(self, flavor: str, **model_kwargs: Any) -> Any: ...


class Loss(Component, Protocol):
    """kind ``loss``: sets ``tc.loss``. ``NEEDS_DATA`` names the data kinds it trains on."""

    NEEDS_DATA: ClassVar[tuple[str, ...]]


class Recompute(Component, Protocol):
    """kind ``recompute``: sets ``tc.activation_checkpoint``; its ``plan_terms`` say what is kept."""


class State(Component, Protocol):
    """kind ``state``: parameter / gradient / optimizer-state sharding (parallelize, optimizer)."""


class MoeComm(Component, Protocol):
    """kind ``moe_comm``: the expert-parallel dispatch/combine backend torchtitan runs."""

    torchtitan_backend: str


class MoeChunk(Component, Protocol):
    """kind ``moe_chunk``: edits the model spec's routed experts (overlap schedule)."""


class Precision(Component, Protocol):
    """kind ``precision``: converts the model spec's linears and sets compile / hooks."""


class Data(Component, Protocol):
    """kind ``data``: sets ``tc.dataloader`` and ``tc.tokenizer``; ``summary`` is the run's first
    line (what it trains on); ``STEP_KEYS`` / ``BATCH_KEYS`` are what its batches carry beyond
    tokens and labels (the trainer forwards them to the loss)."""

    BATCH_KEYS: ClassVar[tuple[str, ...]]

    def summary(self, options: Any, ctx: Context) -> str: ...


class Launcher(Component, Protocol):
    """kind ``launcher``: how ranks start (this machine, Slurm)."""

    def world_size(self, options: Any) -> int: ...

    def launch(self, options: Any, argv: list[str], run_in_process: Any) -> int: ...


PROTOCOLS: dict[str, type] = {
    "model": ModelFamily, "loss": Loss, "recompute": Recompute, "state": State, "moe_comm": MoeComm,
    "moe_chunk": MoeChunk, "precision": Precision, "data": Data, "launcher": Launcher,
}


def missing_members(kind: str, obj: Any) -> list[str]:
    """The members of ``kind``'s Protocol that ``obj`` lacks (for the registry test and `apiary ls`)."""
    proto = PROTOCOLS[kind]
    names = set()
    for klass in proto.__mro__:
        if klass in (object, Protocol) or not getattr(klass, "_is_protocol", False):
            continue
        names |= {n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")}
        names |= {n for n, v in vars(klass).items() if callable(v) and not n.startswith("_")}
    return sorted(n for n in names if not hasattr(obj, n))
