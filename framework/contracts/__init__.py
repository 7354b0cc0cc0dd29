"""The component contracts: what each registry kind provides, checked before launch.

registry.yaml binds ``kind -> name -> module:attr``; the object it names satisfies the Protocol
of its kind below. The framework talks to components only through these members, so it never
names a component module or option. Components import from ``framework`` only this package,
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
3. ``apply(options, tc, ctx)``: called by ``framework.train.build`` in the order of ``APPLY_ORDER``; edits
   torchtitan's ``Trainer.Config`` ``tc`` in place (its model spec, loss, activation checkpoint,
   parallelism, optimizer, dataloader, tokenizer, ...).
4. ``plan_terms(options, ctx)`` (the kinds in ``Planned``): what the component adds to the
   planner's estimate (memory terms, step-time factors), see ``PlanTerms``.
5. ``NUMERICS``: how ``apiary compare`` holds two runs that differ in this component or in one of
   its options to each other (``""``: another name of the same kind; ``"opt"``: that option).

Optional: ``SKILL`` names the docs/skills page of the component when it is not ``<name>.md``
(resolve's error messages point there; the kind's page, e.g. ``recompute.md``, is the fallback).

Every member the framework or the tools read is declared here: required (a member of the kind's
Protocol) or optional, with the default used when the component leaves it out
(``OPTIONAL_MEMBERS``, one table per kind). They read a member through ``member(component, kind,
name)``, never through ``hasattr``/``getattr``, so a name missing from these tables fails at once.


The package, one file per reason to change: ``kinds`` (the kinds, ``SELECT``, ``Context``),
``protocols`` (each kind's members), ``plan`` (what a component tells the planner), ``options``
(``make_options`` and the other Options helpers), ``members`` (required and optional members,
``member``), ``batch`` (batch consumers), ``memory`` (listeners to the allocator's retries), ``grads``
(gradient owners). Its names are re-exported here: components import
``framework.contracts``, never a file of it.
"""

from __future__ import annotations

from framework.contracts.batch import (
    BATCH_CONSUMERS_ATTR,
    add_batch_consumer,
    batch_consumers,
)
from framework.contracts.grads import (
    GRAD_CLIP_OWNER,
    GRAD_SCALE_OWNER,
    GradClipOwner,
    GradScaleOwner,
    StagedHostState,
    gradient_owners,
    own_gradients,
)
from framework.contracts.kinds import (
    APPLY_ORDER,
    GROUP_KINDS,
    KINDS,
    SELECT,
    Context,
    Shared,
    Tolerance,
)
from framework.contracts.members import (
    OPTIONAL_MEMBERS,
    PROTOCOLS,
    RUNTIME_PROTOCOLS,
    UndeclaredMember,
    declared_members,
    member,
    missing_members,
    required_members,
)
from framework.contracts.memory import (
    LEARNED_FILE,
    MEMORY_LISTENERS_ATTR,
    MemoryListener,
    MemoryReaction,
    add_memory_listener,
    memory_listeners,
)
from framework.contracts.options import (
    check_choices,
    choices,
    field_docs,
    make_options,
    options_class,
    schema_of,
)
from framework.contracts.plan import (
    LayerKind,
    LayerShape,
    LayerTerms,
    PlanConstant,
    PlanContext,
    PlanFacts,
    PlanTerms,
    Term,
    block_saves,
    stage_activation_elements,
)
from framework.contracts.protocols import (
    Adapter,
    Component,
    Data,
    DataStepMetrics,
    FollowedData,
    LaunchEnv,
    Launcher,
    Loss,
    LossFn,
    ModelFamily,
    ModelTypeNotRead,
    MoeChunk,
    MoeComm,
    Planned,
    Precision,
    PublishedForm,
    Recompute,
    State,
    Transport,
)

__all__ = [
    "KINDS",
    "APPLY_ORDER",
    "SELECT",
    "GROUP_KINDS",
    "Tolerance",
    "Context",
    "GRAD_CLIP_OWNER",
    "GRAD_SCALE_OWNER",
    "GradClipOwner",
    "GradScaleOwner",
    "StagedHostState",
    "gradient_owners",
    "own_gradients",
    "Shared",
    "Term",
    "PlanTerms",
    "PlanFacts",
    "PlanConstant",
    "LayerShape",
    "LayerTerms",
    "block_saves",
    "stage_activation_elements",
    "LayerKind",
    "PlanContext",
    "Component",
    "Planned",
    "ModelFamily",
    "ModelTypeNotRead",
    "Loss",
    "LossFn",
    "Recompute",
    "State",
    "MoeComm",
    "Transport",
    "MoeChunk",
    "Adapter",
    "PublishedForm",
    "Precision",
    "Data",
    "DataStepMetrics",
    "FollowedData",
    "LaunchEnv",
    "Launcher",
    "BATCH_CONSUMERS_ATTR",
    "add_batch_consumer",
    "batch_consumers",
    "LEARNED_FILE",
    "MEMORY_LISTENERS_ATTR",
    "MemoryListener",
    "MemoryReaction",
    "add_memory_listener",
    "memory_listeners",
    "choices",
    "check_choices",
    "field_docs",
    "schema_of",
    "options_class",
    "make_options",
    "PROTOCOLS",
    "RUNTIME_PROTOCOLS",
    "OPTIONAL_MEMBERS",
    "UndeclaredMember",
    "declared_members",
    "required_members",
    "missing_members",
    "member",
]
