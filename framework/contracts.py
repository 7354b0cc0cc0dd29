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
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import linecache
import textwrap
import typing
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Literal, Mapping, Optional, Protocol, Sequence, runtime_checkable

from omegaconf import DictConfig, ListConfig, OmegaConf

from framework import schema
from framework.errors import UserError

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
    layout: Any = None  # framework.layout.Layout once derived
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


@dataclass
class Term:
    """One line of the planner's per-GPU memory estimate: ``count x bytes_per`` bytes."""

    name: str
    count: float
    bytes_per: float
    # "outside": memory outside torch's caching allocator (e.g. NCCL symmetric memory a communication
    # library allocates): the planner adds it after the allocator's fragmentation and leaves it out of
    # its torch max_memory_reserved estimate
    category: Literal["static", "activations", "buffers", "loss", "outside"]
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
    # multiplies the model FLOPs of a compute part (fwd + bwd with weight gradients, 3 x fwd), and so
    # its time and the TFLOPs a run logs (kind adapter: a frozen base's GEMMs have no weight gradient)
    flops_factor: dict[str, float] = field(default_factory=dict)
    # extra forward FLOPs as a fraction of a part's fwd+bwd FLOPs (recompute)
    extra_compute: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed as assumptions
    # kind-specific numbers the planner reads: loss "objective" (--search varies the loss among
    # those with the recipe's objective), "summary"; recompute "keep" (layer kind -> fraction of
    # saved activations kept), "inputs_only", "forward_reruns", or "blocks" (mixer kind -> blocks of
    # that kind on the stage that are "kept" whole, "partial" (keep "keep" of each kind) or
    # "recomputed" (the block input only)) and "candidates" (PlanTerms, in increasing memory: the
    # planner takes the last that fits the GPU less facts["margin"], the first when none does);
    # state "comm" {name: seconds},
    # "overlap" {name: fraction}, "label"; moe_chunk "chunks", "overlap" (the fraction of the EP
    # all-to-all hidden under compute); precision its FP8 shares
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanConstant:
    """A number a component or a model family's layer kind plans with, and the reason for its value.

    A component declares its own in ``PLAN_CONSTANTS`` ({name: PlanConstant}; a model family
    declares those of its layer kinds). The planner gathers every registered component's into its
    ``Constants``, so users calibrate them by name like the planner's own (``apiary plan
    calib.NAME=VALUE``, ``calibration=FILE``; ``apiary plan --constants`` lists them), and
    ``plan_terms`` read the calibrated value as ``ctx.plan.constants.NAME``. Names are shared by
    every component: two declarations of one name must agree, except that dict-valued ones with
    disjoint keys merge (``loss_time_factor`` gathers each loss's entry)."""

    value: Any
    doc: str


@dataclass(frozen=True)
class LayerShape:
    """What a layer kind's terms depend on: the planned layout of one microbatch on one rank."""

    seq: int  # sequence length (training.seq_len)
    micro_batch: int  # sequences per microbatch
    cp: int  # context-parallel degree (the local tokens are micro_batch x seq / cp)
    tp: int  # tensor-parallel degree
    constants: Any  # the planner's Constants, calibrated (the layer kinds' PLAN_CONSTANTS included)


@dataclass
class LayerTerms:
    """One layer kind's share of the planner's estimate (``LayerKind.plan_terms``): per layer of the
    kind and per token. The planner sums these over the model's layer kinds without knowing them.

    A block is one mixer (its token-mixing layer) and one FFN. Kinds of role "mixer" get a compute
    part of their own (``compute_<name>``, at ``efficiency``) and are what recompute keeps or reruns
    block by block (``ModelFacts.layer_mixers`` names each layer's mixer kind)."""

    name: str  # the kind's name: key of the planner's counts, of recompute's keep and per-block mixes
    role: Literal["mixer", "ffn"]
    layers: int  # layers of this kind in the whole model
    saved_per_token: float  # activation elements one token saves in one layer for backward (no recompute, before TP)
    partial_keep: float = 0.5  # fraction of them kept by a recompute that keeps part of a block
    # mixer: what autograd really saves in a block of this mixer kept whole, over the elements
    # counted for the block (mixer + FFN + norms), by the block's FFN kind ("*": any other; 1.0 default);
    # ffn: what autograd saves in its own part of a block over its count ({"*": factor})
    saved_factor: Mapping[str, float] = field(default_factory=dict)
    flops_per_token: float = 0.0  # fwd + bwd model FLOPs per token in one layer beyond 6 x its parameters
    flops_how: str = ""  # how flops_per_token was counted (printed with the plan's assumptions)
    efficiency: float = 1.0  # achieved / peak FLOPs of those FLOPs (mixer: its own compute part)
    forward_flops_per_token: float = 0.0  # forward FLOPs per token of one layer, projections included
    cp_comm_bytes: float = 0.0  # CP: bytes one rank sends per layer, microbatch and pass (fwd, bwd, rerun)
    cp_memory: list[Term] = field(default_factory=list)  # CP: buffers of one layer of the kind (category buffers)

    def factor_with(self, ffn: str | None) -> float:
        """``saved_factor`` of a block of this mixer with the FFN kind ``ffn``."""
        return float(self.saved_factor.get(ffn, self.saved_factor.get("*", 1.0)))


def block_saves(saved: Mapping[str, float], layers: Mapping[str, "LayerTerms"], keep_partial: Mapping[str, float],
                dim: float, ffn: str | None) -> dict[str, dict[str, tuple[float, float]]]:
    """Per token, for one block of each mixer kind (with the FFN kind ``ffn``) and each way recompute
    treats it: ``(s, r)``, the elements it saves through the forward and the elements its rerun adds
    in backward (the input to ``stage_activation_elements``). ``saved`` are the counted elements per
    kind (and "norms"); a kind's ``saved_factor`` turns a count into what autograd really holds.
    "kept": the whole block; "partial": each kind's ``keep_partial`` of its count, norm inputs all;
    "ffn_rerun": the mixer and norms kept, the FFN rerun from its input (the kept block less the FFN's
    own part); "recomputed": the block input. A rerun brings the block to what keeping it holds."""
    s_ffn = saved[ffn] if ffn else 0.0
    f_ffn = layers[ffn].factor_with(None) if ffn else 1.0
    out = {}
    for m, t in layers.items():
        if t.role != "mixer":
            continue
        kept = (saved[m] + s_ffn + saved["norms"]) * t.factor_with(ffn)
        partial = saved[m] * keep_partial.get(m, 0.5) + s_ffn * keep_partial.get(ffn, 0.5) + saved["norms"]
        out[m] = {"kept": (kept, 0.0), "partial": (partial, max(0.0, kept - partial)),
                  "recomputed": (dim, max(0.0, kept - dim))}
        if ffn:
            out[m]["ffn_rerun"] = (max(dim, kept - s_ffn * f_ffn + dim), s_ffn * f_ffn)
    return out


def stage_activation_elements(layers: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Per token, ``(saved, peak)`` for a stage whose layers, in forward order, each save ``s``
    elements through the forward and add ``r`` more when backward reruns them (``(s, r)`` each):
    the saves of all layers, and the most alive at once. Backward meets the layers last first and
    frees each one's saves once past it, so a layer's rerun coexists with the saves of the layers
    before it only: the peak is the larger of all saves and, over the layers, the saves up to and
    including one plus its rerun. A layer kept at the end of the stage thus costs about what
    rerunning it does: its rerun would materialize the same saves on top of the same layers."""
    before = sum(s for s, _ in layers)
    peak = before
    for s, r in reversed(layers):
        peak = max(peak, before + r)
        before -= s
    return sum(s for s, _ in layers), peak


@runtime_checkable
class LayerKind(Protocol):
    """One kind of layer of a model (``ModelFacts.layer_kinds``): what the planner counts for it.
    A model family with a new kind of layer brings it as such an object; the planner knows none by
    name. Its calibrated constants come in ``shape.constants`` (the family's ``PLAN_CONSTANTS``)."""

    def plan_terms(self, shape: LayerShape) -> LayerTerms: ...


@dataclass
class PlanContext:
    """What the planner adds to ``Context`` (``ctx.plan``) when it asks ``plan_terms``: its
    calibrated constants, the GPU and the shapes of the pipeline stage it is estimating.

    ``plan_terms(options, ctx)`` gets ``options=None`` when the planner asks about a name the
    recipe did not choose (``plan(loss=...)``, ``--search``): the component plans its defaults."""

    constants: Any  # framework.planner.Constants, calibrated; components read their PLAN_CONSTANTS by name
    hw: Any  # framework.planner.Hardware of the planned GPU
    tokens: float  # local tokens per microbatch on one rank (micro_batch x seq_len / cp, before TP)
    micro_batch: int  # sequences per microbatch
    split: dict  # parameters of the whole model: emb, head (+ final norm), dense_blocks, experts
    counts: dict  # layers of each layer kind on one stage (LayerTerms.name; "norms": every layer)
    grad_accum: int = 1  # gradient-accumulation micro-steps per optimizer step
    first: bool = True  # the stage holds the embedding
    last: bool = True  # the stage holds the LM head (and the loss)
    earlier: dict = field(default_factory=dict)  # kind -> PlanTerms of the kinds planned before this one
    link_bw: Any = None  # link_bw(group, stride) -> bytes/s of a collective over group ranks stride apart
    saved: dict = field(default_factory=dict)  # activation elements one token saves per layer kind (no recompute)
    layers: dict = field(default_factory=dict)  # layer kind name -> its LayerTerms on this layout (the model's)


@runtime_checkable
class Component(Protocol):
    """Members every kind shares (see the module docstring)."""

    Options: ClassVar[type]
    NUMERICS: ClassVar[Mapping[str, Tolerance]]  # optional: {} (compare holds a switch of it to nothing)
    SKILL: ClassVar[str]  # optional: None (the docs/skills page is <name>.md, else the kind's)

    def check(self, options: Any, ctx: Context) -> None: ...

    def apply(self, options: Any, tc: Any, ctx: Context) -> None: ...


class Planned(Protocol):
    """Kinds the planner asks for their share of the estimate (loss, recompute, state, moe_comm, moe_chunk,
    precision, adapter). The model's share comes from its ``facts`` (``layer_kinds``: one ``LayerKind``
    per kind of layer); data and launchers add none. ``PLAN_CONSTANTS`` (optional) are the
    component's own calibrated constants (``PlanConstant``)."""

    PLAN_CONSTANTS: ClassVar[Mapping[str, PlanConstant]]  # optional: {} (plans with no constant of its own)

    def plan_terms(self, options: Any, ctx: Context) -> PlanTerms: ...


class ModelFamily(Component, Protocol):
    """kind ``model``: a family module. ``FLAVORS`` names its sizes; ``facts`` sizes a flavor
    without building it; ``apply`` puts the model spec on ``tc``; ``model_kwargs`` are the
    ``model_config`` / ``facts`` arguments the recipe asks for.

    ``hf_writer(options, ctx)`` (optional: a family without it cannot publish weights, which
    resolve refuses before launch when ``publish.interval > 0``): called by ``framework.build`` on
    each rank, returns ``convert(state_dict) -> (hf_tensors, hf_config)``: a full (unsharded)
    torchtitan state dict of this recipe's model -> HF tensor name -> tensor, and the config.json
    dict, such that transformers' ``AutoModelForCausalLM.from_pretrained`` (and vLLM, SGLang) load
    the folder ``framework/publish.py`` writes from them.

    The other optional members (``OPTIONAL_MEMBERS["model"]``) are what the HF tools ask:
    ``HF_MODEL_TYPES`` (config.json ``model_type`` values the family reads: `apiary show`,
    `apiary logprobs`), ``export_hf(run_dir, out_path, *, step, dtype, shard_bytes)`` (`apiary export`:
    checkpoint ``step`` (None: the latest) in ``dtype``, in safetensors shards of at most
    ``shard_bytes``; returns the folder) and
    the pieces the shared HF helpers (``components/models/hf.py``, the adapters' export) build from:
    ``model_config``, ``arch_from_config`` / ``arch_of``, ``hf_config``, ``STATE_DICT_ADAPTER``,
    ``hf_key_shapes`` (a checkpoint key -> canonical (key, shape) pairs) and ``save_hf`` (a
    family's own writer, used instead of the generic one)."""

    FLAVORS: Mapping[str, Any]
    HF_MODEL_TYPES: ClassVar[tuple[str, ...]]  # optional: ()
    LONG_CONTEXT_FLAVORS: ClassVar[Mapping[str, str]]  # optional: {} (flavor -> its RoPE scaling, for hints)
    STATE_DICT_ADAPTER: ClassVar[Any]  # optional: None (torchtitan's HF <-> torchtitan key adapter class)
    PLAN_CONSTANTS: ClassVar[Mapping[str, PlanConstant]]  # optional: {} (its layer kinds' calibrated constants)

    def model_kwargs(self, options: Any, ctx: Context) -> dict: ...

    def facts(self, flavor: str, **model_kwargs: Any) -> Any: ...

    def model_spec(self, flavor: str, **model_kwargs: Any) -> Any: ...

    def hf_writer(self, options: Any, ctx: Context) -> Any: ...

    def export_hf(self, run_dir: str, out_path: str, *, step: int | None = None, dtype: str = "bfloat16",
                  shard_bytes: int | None = None) -> Any: ...

    def model_config(self, flavor: str, **model_kwargs: Any) -> Any: ...

    def arch_from_config(self, model_config: Any) -> Any: ...

    def arch_of(self, flavor: str, **model_kwargs: Any) -> Any: ...

    def hf_config(self, arch: Any) -> dict: ...

    def hf_key_shapes(self, key: str, shape: tuple) -> list: ...

    def save_hf(self, state_dict: dict, arch: Any, out_path: str, model_config: Any) -> Any: ...


class ModelTypeNotRead(UserError):
    """Raised by a family's HF reader for a config.json whose ``model_type`` is not one of its
    ``HF_MODEL_TYPES``. ``framework.resolve`` names in the fix the registry's family that declares
    it (``framework.registry.family_of``); elsewhere the fix points at `apiary show DIR`."""

    def __init__(self, where: str, model_type: str, family: str, fix: str = ""):
        self.model_type, self.family = model_type, family
        super().__init__(where, f"config.json has model_type={model_type}, which model.family={family} does not read.",
                         fix or f"Set model.family to the family that reads model_type={model_type} "
                         "(`apiary show DIR` names it).")


class Loss(Component, Planned, Protocol):
    """kind ``loss``: sets ``tc.loss``. ``NEEDS_DATA`` names the data kinds it trains on (its own
    ``check`` holds it); ``RL_KEYS`` the ``rl.*`` settings it acts on (resolve refuses the others
    when set). The object ``tc.loss`` builds is a ``LossFn``."""

    NEEDS_DATA: ClassVar[tuple[str, ...]]  # optional: None (not declared; the loss's check decides)
    RL_KEYS: ClassVar[tuple[str, ...]]  # optional: () (acts on no rl.* setting)


class LossFn(Protocol):
    """Not a registry kind: the loss object torchtitan builds from ``tc.loss``, as the trainer asks
    it (``member(loss_fn, "loss_fn", NAME)``). A loss that reads per-token batch keys (the policy
    losses) has ``set_batch(batch, seq_group)``, called before each micro-batch's forward with the
    data's ``BATCH_KEYS`` / ``STEP_KEYS`` tensors (context-sharded) and the context-parallel group;
    after its forward, ``metrics`` (name -> scalar tensor; ``*_max`` keys are maxima) weighted by
    ``metric_weight`` (the micro-batch's trained tokens) are what the trainer logs."""

    metrics: Mapping[str, Any]  # optional: {}
    metric_weight: Any  # optional: None (nothing to log)

    def set_batch(self, batch: dict, seq_group: Any) -> None: ...  # optional: None (reads no batch keys)


class Recompute(Component, Planned, Protocol):
    """kind ``recompute``: sets ``tc.activation_checkpoint``; its ``plan_terms`` say what is kept."""


class State(Component, Planned, Protocol):
    """kind ``state``: parameter / gradient / optimizer-state sharding (parallelize, optimizer).

    ``layout(options, dims) -> (dims, reason)`` (optional): the parallel degrees this backend runs,
    from the ones ``framework.layout.derive`` chose (a backend with no replicate/shard split folds
    one into the other). Resolve applies it right after deriving, before anything reads the layout,
    so layout.json, the printed dims, the planner and the trainer see the same degrees; it may move
    degrees between dims, never change the world size. ``reason`` is what layout.json's rules say
    for the dims it changed."""

    def layout(self, options: Any, dims: dict[str, int]) -> tuple[dict[str, int], str]: ...


class MoeComm(Component, Planned, Protocol):
    """kind ``moe_comm``: the expert-parallel dispatch/combine backend torchtitan runs; its ``plan_terms``
    add what the backend allocates besides the dispatch/combine buffers the planner counts from the
    model's shapes (e.g. a fixed communication buffer)."""

    torchtitan_backend: str


class Transport(Component, Planned, Protocol):
    """kind ``transport`` (``publish.transport``): how published weights reach the generator.
    ``IN_MEMORY``: False for HF folders only (framework/publish.py writes every version); True when
    ``sender(options, settings, trainer)`` (called on every rank once the trainer is built;
    ``settings``: framework.publish.PublishSettings) returns an object whose ``publish(trainer,
    version)`` (a collective) hands every version after the first to the engine, and ``close()``.
    Its ``plan_terms`` memory is what rank 0 holds for the hand-off (the planner adds it to the
    first stage)."""

    IN_MEMORY: ClassVar[bool]

    def sender(self, options: Any, settings: Any, trainer: Any) -> Any: ...


class MoeChunk(Component, Planned, Protocol):
    """kind ``moe_chunk``: edits the model spec's routed experts (overlap schedule)."""


class Adapter(Component, Planned, Protocol):
    """kind ``adapter``: converts the model spec before it is built (adapters on a frozen base) and
    its checkpoint; its ``plan_terms`` may replace the state backend's static terms by name
    (``facts["replace"]``), scale its buffers and traffic (``facts["buffer_scale"]``,
    ``facts["comm_scale"]``) and the optimizer step (``facts["trainable_fraction"]``).

    ``export_hf(run_dir, out_path, family, *, merged)`` (optional): `apiary export` of a run that
    trained adapters; returns (folder, what it holds): the adapters alone (PEFT's format) or, with
    ``merged``, the model with the adapters folded in.

    ``published_form(options, ctx)`` (optional): what weight publication (framework/publish.py) writes
    for a run with this adapter, a ``PublishedForm``; left out, or returning None, the model family's
    ``hf_writer`` (the whole model) is published."""

    def export_hf(self, run_dir: str, out_path: str, family: Any, *, merged: bool = False) -> tuple: ...

    def published_form(self, options: Any, ctx: Context) -> Any: ...


@dataclass(frozen=True)
class PublishedForm:
    """What one published version holds (framework/publish.py writes it as ``DIR/step-V``):
    ``convert`` maps the gathered state dict to (tensors, the config file's body); ``select`` picks
    the state-dict keys gathered (None: all); the tensors go to ``WEIGHTS.safetensors`` (sharded as
    ``WEIGHTS-0000i-of-0000n`` above the shard size when ``shardable``) and the body to ``config``;
    ``loader_files`` adds what a model loader reads beside the weights (tokenizer files,
    generation_config.json); ``describe`` names the form in the publication line."""

    convert: Callable[[dict], tuple[dict, dict]]
    select: Optional[Callable[[str], bool]] = None
    weights: str = "model"
    config: str = "config.json"
    shardable: bool = True
    loader_files: bool = True
    describe: str = "weights"


class Precision(Component, Planned, Protocol):
    """kind ``precision``: converts the model spec's linears and sets compile / hooks."""


class Data(Component, Protocol):
    """kind ``data``: sets ``tc.dataloader`` and ``tc.tokenizer``; ``summary`` is the run's first
    line (what it trains on); ``STEP_KEYS`` / ``BATCH_KEYS`` are what its batches carry beyond
    tokens and labels (the trainer forwards them to the loss)."""

    BATCH_KEYS: ClassVar[tuple[str, ...]]  # per token (context-parallel sharded like the tokens)
    STEP_KEYS: ClassVar[tuple[str, ...]]  # per sample (not sharded)

    def summary(self, options: Any, ctx: Context) -> str: ...

    def ignored_keys(self, options: Any, ctx: Context) -> Mapping[str, tuple[str, str]]:
        """Optional (None: the format reads every ``data.*`` key it is given): the ``data.*`` keys this
        format, with these options, does not read -> (what it reads instead, what to do). ``resolve``
        refuses such a key given on the command line (a value the recipe sets stays accepted)."""
        ...


@runtime_checkable
class FollowedData(Protocol):
    """A dataset that follows a growing folder (``data.follow``): the trainer asks, at each step's
    start, whether the next step's rows can be formed from what is there now (every rank alike; the
    trainer agrees on the answer over ranks, waits, and stops on a signal or a timeout), and after
    the step for what it consumed."""

    NOUN: str  # what it waits for, in the status line ("waiting for NOUN in DIR: 12 s")
    LEDGER: str  # the file in the run folder that lists, per step, the records it trained
    dir: Any  # the folder it follows (the DIR of the status line and of the stop messages)

    def ready(self) -> bool: ...  # the next step's rows can be formed now (ValueError: a malformed shard)

    def waiting_note(self) -> str: ...  # what the status line adds while waiting (drops, last shard)

    def held(self) -> str: ...  # what the folder holds of the step waited for, in words ("": nothing of it)

    def step_report(self, step: int) -> dict | None: ...  # the records step ``step`` trained, once

    def step_metrics(self, step: int) -> dict[str, float]: ...  # scalars for metrics.jsonl ("data/..." keys)


@dataclass
class LaunchEnv:
    """What the framework hands a launcher at launch (so launchers import nothing else of it)."""

    resolved: Any  # framework.resolve.Resolved: the run being launched
    supervise: Any  # supervise(cmd, env, nproc) -> exit code: run torchrun and forward stop signals
    # run_here() -> exit code: train ``resolved`` in this process (one rank; framework.run.train_here)
    run_here: Any = None
    # worker_env() -> {name: value}: writes the resolved run into its folder and returns the environment
    # variables that hand it to the ranks a launcher starts (they load it instead of resolving again)
    worker_env: Any = None
    warned: bool = False  # the launcher's preflight warnings were printed already (apiary launch)
    worker_module: str = "framework.lifecycle"  # `python -m MODULE torchrun ...` starts torchrun quietly
    train_module: str = "framework.cli"  # `python -m MODULE train ARGS` is one rank


class Launcher(Component, Protocol):
    """kind ``launcher``: how ranks start (this machine, Slurm). ``RUNS_HERE``: the ranks run on
    this machine (its GPU is the one to check before launch)."""

    RUNS_HERE: ClassVar[bool]
    TEMPLATE: ClassVar[Any]  # optional: None (the script template `apiary cp-template` copies)

    def world_size(self, options: Any) -> int: ...

    def launch(self, options: Any, argv: list[str], env: LaunchEnv) -> int: ...

    # optional (None): checks of the launcher's own options before resolve (``check_options(options)``),
    # the launch's warnings (``preflight(options, resolved, *, dry_run) -> list[str]``) and, for a
    # launcher that submits a batch script (Slurm), the script (``render(options, resolved, argv) -> str``;
    # the job's rank 0 then takes the run lock, not the launching process)
    def check_options(self, options: Any) -> None: ...

    def preflight(self, options: Any, resolved: Any, *, dry_run: bool = False) -> list[str]: ...

    def render(self, options: Any, resolved: Any, argv: list[str]) -> str: ...


# ---------------------------------------------------------------------------------------------
# Batch consumers: per-token model inputs that are not forward arguments
# ---------------------------------------------------------------------------------------------

BATCH_CONSUMERS_ATTR = "_apiary_batch_consumers"  # on a model part: {batch key: consumer}


def add_batch_consumer(model: Any, key: str, consumer: Any) -> None:
    """Register ``consumer(tensor | None)`` on a model part (a component does it on the model it
    builds, e.g. in a wrapped ``parallelize_fn``, so the registration lives and dies with that
    model). Before every micro-batch's forward the trainer calls it with the batch's ``key`` tensor
    (one of the data component's ``BATCH_KEYS``: on the device, context-parallel sharded like the
    tokens along dim 1, trailing dims kept), or with None when the batch has no such key; the
    consumer keeps what it needs on the model's modules for that forward and its recompute."""
    consumers = getattr(model, BATCH_CONSUMERS_ATTR, None)
    if consumers is None:
        consumers = {}
        setattr(model, BATCH_CONSUMERS_ATTR, consumers)
    consumers[key] = consumer


def batch_consumers(model_parts: Any) -> dict[str, list]:
    """The consumers registered on ``model_parts``: batch key -> [consumer, ...]."""
    out: dict[str, list] = {}
    for part in model_parts:
        for key, consumer in (getattr(part, BATCH_CONSUMERS_ATTR, None) or {}).items():
            out.setdefault(key, []).append(consumer)
    return out


# ---------------------------------------------------------------------------------------------
# Options helpers (OmegaConf has no Literal type; the recipe schema stores the base type)
# ---------------------------------------------------------------------------------------------


def choices(tp: Any) -> tuple | None:
    """The values of a ``Literal[...]`` annotation (``Optional[Literal[...]]`` too), else None."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        for a in typing.get_args(tp):
            if typing.get_origin(a) is Literal:
                return typing.get_args(a)
    return None


def check_choices(obj: Any, prefix: str, where: str = "") -> None:
    """ValueError naming ``prefix + field`` for a field outside its ``Literal`` choices
    (call it first in an Options' ``__post_init__``)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        names = choices(hints.get(f.name))
        value = getattr(obj, f.name)
        if names is not None and value is not None and value not in names:
            raise ValueError(f"{prefix}{f.name} must be {'|'.join(map(str, names))}{where}, got {value!r}")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's doc: the string literal after it (torchtitan's style) or its ``# comment``,
    read from the class's source and its bases' (empty where the source cannot be read)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            src = textwrap.dedent(_class_source(klass))
        except (OSError, TypeError):
            continue
        lines = src.splitlines()
        body = ast.parse(src).body[0].body
        for stmt, nxt in zip(body, [*body[1:], None]):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
            elif "#" in lines[stmt.end_lineno - 1]:
                docs[stmt.target.id] = lines[stmt.end_lineno - 1].split("#", 1)[1].strip()
    return docs


@functools.lru_cache(maxsize=None)
def _classes_in(path: str) -> tuple[list[str], dict[str, ast.ClassDef]]:
    """A source file's lines and its classes by qualified name, parsed once per file (`train --help`
    reads the docs of some 40 classes in a dozen files; inspect.getsource parses the file for each)."""
    lines = linecache.getlines(path)
    out: dict[str, ast.ClassDef] = {}

    def walk(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(prefix + node.name, node)
                walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(node.body, f"{prefix}{node.name}.<locals>.")

    walk(ast.parse("".join(lines)).body, "")
    return lines, out


def _class_source(klass: type) -> str:
    """``inspect.getsource(klass)`` from the class statement on, through a per-file cache."""
    path = inspect.getsourcefile(klass)
    if path is not None:
        lines, classes = _classes_in(path)
        node = classes.get(klass.__qualname__)
        if node is not None:
            return "".join(lines[node.lineno - 1: node.end_lineno])
    return inspect.getsource(klass)


def schema_of(options_cls: type) -> type:
    """A dataclass OmegaConf can type-check: ``options_cls`` with ``Literal`` fields as ``str``
    (their choices are checked by ``options_cls.__post_init__``) and no ``__post_init__``."""
    hints = typing.get_type_hints(options_cls)
    out = []
    for f in dataclasses.fields(options_cls):
        tp = hints[f.name]
        names = choices(tp)
        if names is not None:
            base = type(names[0])
            tp = typing.Optional[base] if type(None) in typing.get_args(tp) else base
        default = (f.default if f.default is not dataclasses.MISSING else
                   field(default_factory=f.default_factory) if f.default_factory is not dataclasses.MISSING
                   else dataclasses.MISSING)
        out.append((f.name, tp) if default is dataclasses.MISSING else (f.name, tp, default))
    return dataclasses.make_dataclass(f"{options_cls.__qualname__.replace('.', '_')}_schema", out, kw_only=True)


@functools.lru_cache(maxsize=None)
def _over_section(options_cls: type, section: type) -> type:
    """``options_cls`` (a component's validator of a shared section: its ``__post_init__``, no keys of
    the section) with the keys, types and defaults of ``section`` (the framework's schema dataclass of
    that section, their one definition): an instance of ``options_cls`` that has the section's fields."""
    combined = type(options_cls.__name__, (options_cls, section),
                    {"__module__": options_cls.__module__, "__qualname__": options_cls.__qualname__,
                     "__doc__": options_cls.__doc__})
    return dataclass(kw_only=True)(combined)


def _schema_section(node: Any) -> type | None:
    """The schema dataclass of a recipe section: its node's type, or, in an untyped config (a run's
    resolved file read back), the type of the ``RecipeConfig`` field its key names; None for a
    component group (typed by its ``Options``) or anything else."""
    if not isinstance(node, DictConfig):
        return None
    t = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(t):
        return t
    parent = node._get_parent()
    if parent is None or parent._get_parent() is not None:  # a top-level section of the recipe only
        return None
    t = typing.get_type_hints(schema.RecipeConfig).get(node._key())
    return t if dataclasses.is_dataclass(t) else None


def options_class(component: Any, node: Any) -> type:
    """The class ``make_options`` builds for ``component`` from ``node``: its ``Options``, or, for a
    section the framework's schema types and several kinds share (``model``, ``data``, ``moe``:
    ``SELECT``), its ``Options`` over that schema dataclass, whose keys the ``Options`` does not repeat."""
    cls = component.Options
    section = _schema_section(node)
    if section is not None and not issubclass(cls, section):
        own = {f.name for f in dataclasses.fields(cls)}
        if any(f.name not in own for f in dataclasses.fields(section)):
            return _over_section(cls, section)
    return cls


def make_options(component: Any, node: Any) -> Any:
    """``component.Options`` built from a recipe section (the keys it declares; for a shared section
    the schema's keys too, ``options_class``); ValueError from its ``__post_init__`` when a value is
    out of range."""
    cls = options_class(component, node)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in node:
            v = node[f.name]
            kw[f.name] = OmegaConf.to_container(v) if isinstance(v, (DictConfig, ListConfig)) else v
    return cls(**kw)


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
              "save_hf": None,  # the generic writer (hf.save) writes the family's folder
              "PLAN_CONSTANTS": MappingProxyType({})},  # its layer kinds plan with no calibrated constant
    "adapter": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL,
                "export_hf": None,  # `apiary export` of a run with this adapter is refused
                "published_form": None},  # publication writes the model family's whole folder
    "precision": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL},
    "moe_comm": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL},
    "moe_chunk": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL},
    "data": {**_SHARED_OPTIONAL,
             "ignored_keys": None},  # reads every data.* key it is given
    "loss": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL, "NEEDS_DATA": None, "RL_KEYS": ()},
    "recompute": {**_SHARED_OPTIONAL, **_PLANNED_OPTIONAL},
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
        raise UndeclaredMember(f"{name!r} is not a member of the {kind} contract (framework/contracts.py "
                               f"declares {', '.join(sorted(declared_members(kind)))}); declare it in the "
                               f"Protocol, and its default in OPTIONAL_MEMBERS[{kind!r}] when optional.")
    optional = OPTIONAL_MEMBERS[kind]
    if name in optional:
        return getattr(component, name, optional[name])
    return getattr(component, name)
