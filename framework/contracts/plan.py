"""What a component tells the planner: memory terms, step-time factors (``PlanTerms``), calibrated
constants, and the layer kinds of a model (``LayerKind`` -> ``LayerTerms``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Protocol, Sequence, runtime_checkable


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


@dataclass(slots=True)
class PlanFacts:
    """The kind-specific numbers a component's ``PlanTerms`` tells the planner, one declared field each
    (an undeclared one is refused: ``PlanFacts(other=1)`` raises TypeError, setting one AttributeError).
    A field left at its default is what the planner assumes when a component says nothing."""

    # kind data
    document_tokens: float | None = None
    """the mean document length a token sits in (sum L^2 / sum L); None: documents as long as a row"""
    # kind loss (and adapter: summary)
    objective: str | None = None
    """what the loss optimises: ``--search`` varies the loss among those with the recipe's objective"""
    summary: str | None = None
    """a few words on the component, shown when the planner plans a name it does not know as this one"""
    # kind recompute
    keep: dict[str, float] = field(default_factory=dict)
    """layer kind (and "norms") -> fraction of its saved activations kept"""
    inputs_only: bool = False
    """only each block's input is kept (full recompute)"""
    forward_reruns: float = 0.0
    """forwards rerun in backward per block (a fraction under a per-block mix): the passes of EP, CP, TP traffic"""
    blocks: dict[str, dict[str, int]] | None = None
    """a per-block mix: mixer kind -> {"kept", "ffn_rerun", "partial", "recomputed"} -> blocks of that
    kind on the stage treated so; None: one policy for every block"""
    layers: list[tuple[str, str]] | None = None
    """the mix placed layer by layer, in forward order: (mixer kind, how the block is treated)"""
    candidates: list[PlanTerms] | None = None
    """terms that plan by memory budget, in increasing memory: the planner takes the last that fits
    the GPU less ``fit_margin``, the first when none does"""
    fit_margin: float = 0.0
    """fraction of the GPU's memory the choice among ``candidates`` leaves unplanned"""
    budget_bytes: int | None = None
    """the memory the choice among ``candidates`` fits instead of the GPU's"""
    reason: str = ""
    """set by the planner on the chosen candidate: why it was chosen"""
    fallbacks: list[dict[str, dict[str, int]]] = field(default_factory=list)
    """set by the planner on the chosen candidate: the ``blocks`` of the cheaper candidates, nearest first"""
    # kind moe_chunk
    chunks: int = 1
    """chunks the dispatch/combine buffers of one MoE layer are split into"""
    ep_overlap: float = 0.0
    """the fraction of the EP all-to-all hidden under compute"""
    fp32_combine: bool = False
    """the MoE combine accumulates in fp32 (the planner's constants for that setting)"""
    # kind state
    comm: dict[str, float] = field(default_factory=dict)
    """collective name -> seconds on the wire per optimizer step"""
    overlap: dict[str, float] = field(default_factory=dict)
    """collective name -> the fraction of ``comm`` hidden under compute"""
    label: str | None = None
    """the name the step-time assumptions give the state backend (None: its registry name)"""
    # kind adapter
    trainable_fraction: float = 1.0
    """the fraction of the parameters that train (the optimizer step's share)"""
    replace: dict[str, Term] = field(default_factory=dict)
    """state memory term name -> the term that replaces it (a frozen base has no gradient or optimizer state)"""
    buffer_scale: dict[str, float] = field(default_factory=dict)
    """state buffer term name -> the factor its count is scaled by"""
    comm_scale: dict[str, float] = field(default_factory=dict)
    """state collective name -> the factor its traffic is scaled by"""
    drop_loss_terms: tuple[str, ...] = ()
    """loss memory terms that do not exist under the adapter (a frozen LM head has no dW accumulator)"""
    # kind precision
    dense_share: float = 0.0
    """the share of the dense blocks' parameters in FP8-converted linears"""
    fp8_all_gather: bool = False
    """FSDP all-gathers the converted linears in FP8 (1 B/element)"""


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
    # the kind-specific numbers the planner reads (PlanFacts); a mapping given here is taken as
    # PlanFacts(**mapping), so an undeclared key raises TypeError
    facts: PlanFacts = field(default_factory=PlanFacts)

    def __post_init__(self):
        if not isinstance(self.facts, PlanFacts):
            self.facts = PlanFacts(**self.facts)


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
    # of flops_per_token, the part that grows with the context a token attends (counted for a causal
    # mask over the whole sequence): the step time scales it by the data's documents (a packed row of
    # short documents attends within each one), the model FLOPs a run logs keep it whole
    context_flops_per_token: float = 0.0
    forward_flops_per_token: float = 0.0  # forward FLOPs per token of one layer, projections included
    # mixer: the fraction of its own compute part (flops_per_token) that a recompute keeping part of a block
    # (op-level: a list of ops whose outputs it saves) reruns in backward: 1.0 where its kernels' outputs are
    # not on that list, 0.0 where they are
    partial_rerun: float = 1.0
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

    constants: Any  # framework.plan.planner.Constants, calibrated; components read their PLAN_CONSTANTS by name
    hw: Any  # framework.plan.planner.Hardware of the planned GPU
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
