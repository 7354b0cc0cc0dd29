"""Per-GPU memory of one pipeline stage: shapes of the model, then a list of named terms.

Terms, in order: the state backend's static state; activations kept for backward (as the
recompute component says); the backward working set of one block; with CP, what those two take
beyond their count (a fitted fraction); MoE dispatch/combine
buffers (per the moe_chunk component's chunk count); the precision's buffers; the loss's terms
(last stage); the state backend's buffers; CP buffers; the reserve (fragmentation, CUDA context
and NCCL). The components' terms come from their ``plan_terms``, the model's per layer kind from
its ``ModelFacts.layer_kinds`` (framework.contracts.LayerTerms); the rest is model shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from framework.contracts import LayerShape, LayerTerms, PlanTerms, block_saves, stage_activation_elements
from framework.plan.planner.constants import Constants, GiB

# the group of terms outside torch's caching allocator (contracts.Term's category "outside")
OUTSIDE = "outside"


@dataclass
class Term:
    """One memory term: ``count`` elements (or units) of ``bytes_per`` bytes each."""

    name: str
    count: float
    bytes_per: float
    group: str  # static | activations | loss | buffers | reserve | outside
    formula: str

    @property
    def bytes(self) -> int:
        return int(round(self.count * self.bytes_per))

    @classmethod
    def of(cls, t) -> "Term":
        """A component's ``framework.contracts.Term``."""
        return cls(t.name, t.count, t.bytes_per, t.category, t.how)


# --------------------------------------------------------------------------------------------
# shapes


def layer_terms(f, shape: LayerShape) -> dict[str, LayerTerms]:
    """Each of the model's layer kinds' terms on this layout, by name (``ModelFacts.layer_kinds``)."""
    out = {}
    for kind in f.layer_kinds:
        t = kind.plan_terms(shape)
        out[t.name] = t
    return out


def per_token_saved(f, cp: int, c: Constants | None = None, layers: dict | None = None) -> dict[str, float]:
    """Activation elements one token saves for backward in one layer of each kind (no recompute),
    before the TP split; ``norms``: the two RMSNorm inputs every layer saves (2 x dim)."""
    if layers is None:
        layers = layer_terms(f, LayerShape(seq=0, micro_batch=1, cp=cp, tp=1, constants=c or Constants()))
    return {**{k: float(t.saved_per_token) for k, t in layers.items()}, "norms": 2 * f.dim}


def layer_counts(f, pp: int, layers: dict | None = None) -> dict[str, float]:
    """Layers of each kind on one pipeline stage (fractions when pp does not split kinds evenly)."""
    if layers is None:
        layers = layer_terms(f, LayerShape(seq=0, micro_batch=1, cp=1, tp=1, constants=Constants()))
    return {**{k: t.layers / pp for k, t in layers.items()}, "norms": f.n_layers / pp}


def mixers(layers: dict) -> list[str]:
    """The mixer kinds (each block's token-mixing layer) among ``layers``."""
    return [k for k, t in layers.items() if t.role == "mixer"]


def block_ffn(layers: dict, counts: dict, saved: dict) -> str | None:
    """The FFN kind of the stage's blocks (the one with the most saves among those present)."""
    ffns = [k for k, t in layers.items() if t.role == "ffn" and counts.get(k, 0) > 0]
    return max(ffns, key=lambda k: saved[k], default=None)


def param_split(f, c: Constants) -> dict[str, float]:
    emb = f.vocab_size * f.dim
    head = 0 if c.tied_embeddings else emb
    blocks = max(0.0, f.n_params - emb - head - f.dim)
    experts = min(float(f.n_expert_params), blocks)
    return {"emb": emb, "head": head + f.dim, "dense_blocks": blocks - experts, "experts": experts}


@dataclass
class Shapes:
    """What the memory and time estimates share: the model, layout and token counts of one rank."""

    f: object  # ModelFacts
    lay: object  # Layout
    c: Constants
    seq: int
    local_batch: int
    mb: int  # sequences per microbatch
    n_mb: int  # microbatches per micro-step (PP)
    grad_accum: int
    counts: dict[str, float]
    saved: dict[str, float]
    split: dict[str, float]
    layers: dict[str, LayerTerms] = field(default_factory=dict)  # the model's layer kinds on this layout
    warnings: list[str] = field(default_factory=list)

    @property
    def T(self) -> float:
        """Local tokens per microbatch on one rank (before the sequence-parallel split)."""
        return self.mb * self.seq / self.lay.cp

    @property
    def Tt(self) -> float:
        """Per rank after TP (sequence parallel)."""
        return self.T / self.lay.tp

    @classmethod
    def of(cls, resolved, c: Constants) -> "Shapes":
        cfg, f, lay = resolved.cfg, resolved.facts, resolved.layout
        seq, lb, pp = int(cfg.training.seq_len), int(cfg.training.local_batch), lay.pp
        warnings = []
        if pp > 1:
            mb = int(getattr(cfg.parallel, "pp_microbatch_size", 1) or 1)
            n_mb = max(1, lb // mb)
            if n_mb < pp:
                warnings.append(f"PP {pp} with {n_mb} microbatch(es) per step (local_batch {lb} / "
                                f"pp_microbatch_size {mb}): the pipeline bubble is {pp - 1}/{n_mb + pp - 1} of the step.")
        else:
            mb, n_mb = lb, 1
        layers = layer_terms(f, LayerShape(seq=seq, micro_batch=mb, cp=lay.cp, tp=lay.tp, constants=c))
        return cls(f=f, lay=lay, c=c, seq=seq, local_batch=lb, mb=mb, n_mb=n_mb,
                   grad_accum=int(getattr(resolved, "grad_accum", 1) or 1), counts=layer_counts(f, pp, layers),
                   saved=per_token_saved(f, lay.cp, c, layers), split=param_split(f, c), layers=layers,
                   warnings=warnings)


# --------------------------------------------------------------------------------------------
# terms of one stage


def _ffn(sh: Shapes) -> str | None:
    return block_ffn(sh.layers, sh.counts, sh.saved)


def _mixed_activations(sh: Shapes, rec: PlanTerms, in_flight: int) -> Term:
    """Saved activations of a per-block mix of policies (``rec.facts.blocks``, placed layer by
    layer as ``rec.facts.layers`` says): the block inputs full recompute saves, plus what the mix
    adds to the stage's peak of saves and reruns over every block recomputed
    (framework.contracts.block_saves, stage_activation_elements). With the working set below, every
    block recomputed plans what recompute=full does."""
    Tt, c = sh.Tt, sh.c
    elems = block_saves(sh.saved, sh.layers, rec.facts.keep, float(sh.f.dim), _ffn(sh))
    order = rec.facts.layers or [(m, p) for m, by in rec.facts.blocks.items()
                                        for p, k in by.items() for _ in range(int(k))]
    order = [(m, p) for m, p in order if m in elems]
    _, peak = stage_activation_elements([elems[m][p] for m, p in order])
    _, peak0 = stage_activation_elements([elems[m]["recomputed"] for m, _ in order])
    inputs = len(order) * float(sh.f.dim)
    per_tok = inputs + peak - peak0
    desc = [f"{n:g} {mixer} {policy}" for mixer, by in rec.facts.blocks.items() for policy, n in by.items() if n]
    return Term("activations", in_flight * Tt * per_tok, c.act_bytes, "activations",
                f"{in_flight} microbatch(es) x {Tt:,.0f} tokens x ({inputs:,.0f} block inputs + {peak - peak0:,.0f} "
                f"the kept blocks add to the stage's peak) elements per token (blocks: {', '.join(desc)}; "
                "kept parts x the measured saves of their kind)")


def activation_terms(sh: Shapes, recompute: str, rec: PlanTerms, in_flight: int) -> list[Term]:
    """Saved activations of the microbatches in flight, and one block's backward working set."""
    f, c, pp, Tt, saved, counts = sh.f, sh.c, sh.lay.pp, sh.Tt, sh.saved, sh.counts
    ab = c.act_bytes
    keep = rec.facts.keep
    present = [k for k in mixers(sh.layers) if counts[k] > 0]
    mixer = max(present, key=lambda k: saved[k], default=None)
    ffn = _ffn(sh)
    block = [k for k in (mixer, ffn) if k is not None]
    block_elems = sum(saved[k] for k in block) + saved["norms"]
    if rec.facts.blocks is not None or all(keep.get(k, 0) >= 1 for k in saved):  # a per-block mix, or every block kept
        blocks = rec.facts.blocks or {m: {"kept": counts[m]} for m in mixers(sh.layers) if counts[m] > 0}
        t = [_mixed_activations(sh, PlanTerms(facts=replace(rec.facts, blocks=blocks)), in_flight)]
        redo_elems = sum(saved[k] for k in (*block, "norms"))  # the largest block's rerun, as full plans it
    elif rec.facts.inputs_only:
        t = [Term("activations", in_flight * Tt * f.n_layers / pp * f.dim, ab, "activations",
                  f"{in_flight} microbatch(es) x {Tt:,.0f} tokens x {f.n_layers / pp:g} layers x "
                  f"dim {f.dim} (block inputs only)")]
        redo_elems = sum(saved[k] * (1 - keep[k]) for k in (*block, "norms"))
    else:
        per_tok = sum(counts[k] * saved[k] * keep[k] for k in saved)
        t = [Term("activations", in_flight * Tt * per_tok, ab, "activations",
                  f"{in_flight} microbatch(es) x {Tt:,.0f} tokens x {per_tok:,.0f} saved elements "
                  f"per token per stage ({recompute})")]
        redo_elems = sum(saved[k] * (1 - keep[k]) for k in (*block, "norms"))
    # the largest block (mixer + FFN + norms) rerun in backward (the part not kept) + its gradients
    what = " + ".join(block) or "norms"
    t.append(Term("activation_working_set", Tt * (redo_elems + c.grad_working_factor * block_elems), ab,
                  "activations", f"one {what} block: {Tt:,.0f} tokens x ({redo_elems:,.0f} recomputed + "
                  f"{c.grad_working_factor:g} x {block_elems:,.0f} gradient) elements x {ab:g} B"))
    return t


def moe_terms(sh: Shapes, chunking: PlanTerms) -> list[Term]:
    """Dispatch/combine buffers of one MoE layer, split over the chunks the moe_chunk policy runs."""
    f, c, Tt = sh.f, sh.c, sh.Tt
    if not f.num_experts:
        return []
    ab, chunks = c.act_bytes, chunking.facts.chunks
    return [Term("moe_dispatch_combine", Tt * f.top_k * f.dim * c.moe_buffer_copies * c.ep_load_imbalance / chunks,
                 ab, "buffers", f"top_k {f.top_k} x {Tt:,.0f} tokens x dim {f.dim} x {c.moe_buffer_copies:g} buffers x "
                 f"imbalance {c.ep_load_imbalance:g} / {chunks} chunk(s) x {ab:g} B")]


def cp_terms(sh: Shapes) -> list[Term]:
    """CP: the buffers each layer kind present on the stage says one of its layers holds."""
    if sh.lay.cp <= 1:
        return []
    return [Term.of(x) for k, t in sh.layers.items() if sh.counts[k] > 0 for x in t.cp_memory]


def cp_activation_terms(sh: Shapes, activations: list[Term]) -> list[Term]:
    """CP: what the activation terms take beyond their count on a context-parallel rank
    (``Constants.cp_activation_overhead``, fitted on two H200s at CP 2); none at cp 1."""
    if sh.lay.cp <= 1 or not sh.c.cp_activation_overhead:
        return []
    counted = sum(t.bytes for t in activations)
    return [Term("cp_activation_overhead", counted, sh.c.cp_activation_overhead, "activations",
                 f"{sh.c.cp_activation_overhead:g} x the activation terms {counted / GiB:.2f} GiB (cp {sh.lay.cp})")]


def reserve_terms(c: Constants, terms: list[Term]) -> list[Term]:
    """Allocator fragmentation over the allocated terms; CUDA context and NCCL outside the allocator."""
    allocated = sum(x.bytes for x in terms)
    return [Term("fragmentation", allocated, c.fragmentation_fraction, "reserve",
                 f"{c.fragmentation_fraction:g} x allocated {allocated / GiB:.2f} GiB"),
            Term("cuda_context_nccl", 1, c.cuda_context_bytes + c.nccl_bytes, "reserve",
                 f"CUDA context {c.cuda_context_bytes / GiB:g} GiB + NCCL {c.nccl_bytes / GiB:g} GiB")]


def of_category(pt: PlanTerms, *categories: str) -> list[Term]:
    return [Term.of(t) for t in pt.memory if t.category in categories]


def stage_terms(sh: Shapes, *, state: PlanTerms, recompute: str, rec: PlanTerms, chunking: PlanTerms,
                precision: PlanTerms, loss: PlanTerms | None, in_flight: int,
                transport: PlanTerms | None = None, comm: PlanTerms | None = None) -> list[Term]:
    """Every memory term of one stage (``loss`` None: the stage holds no LM head; ``transport``: the
    weight hand-off's buffers, on the stage of rank 0; ``comm``: the moe_comm backend's own). Terms of
    category "outside" (outside torch's allocator) come after the reserve: no fragmentation on them."""
    t = of_category(state, "static")
    acts = activation_terms(sh, recompute, rec, in_flight)
    t += acts + cp_activation_terms(sh, acts)
    t += moe_terms(sh, chunking)
    if comm is not None:
        t += [Term.of(x) for x in comm.memory if x.category != OUTSIDE]
    t += [Term.of(x) for x in precision.memory]
    if transport is not None:
        t += [Term.of(x) for x in transport.memory]
    if loss is not None:
        t += [Term.of(x) for x in loss.memory]
    t += of_category(state, "buffers", "activations", "loss")
    t += cp_terms(sh)
    outside = [Term.of(x) for pt in (comm,) if pt is not None for x in pt.memory if x.category == OUTSIDE]
    return t + reserve_terms(sh.c, t) + outside
