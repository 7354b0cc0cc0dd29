"""Activation recompute policies: torchtitan's activation checkpointing per block."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from components.recompute.placement import POLICY_OF, per_layer_words
from framework.contracts import PlanConstant, PlanFacts, PlanTerms, block_saves, stage_activation_elements

# the planner's constant of the recompute policies (the layer kinds' selective_keep and
# saved_activation_factor are the model's: components/models/layer_kinds.py); calibrate as
# `apiary plan calib.NAME=VALUE` (docs/skills/planner.md)
PLAN_CONSTANTS = {
    "selective_recompute_fraction": PlanConstant(
        1.0, "selective: the share of full recompute's extra GEMM time (dense, experts) it still pays. Measured on "
             "one H200 (4-layer Qwen3.5-35B-A3B at full width): 1.01x full at 32K (52,773 against 52,197 tok/s), "
             "0.98-0.99x at 32K and 64K with single blocks selective (2026-11-27): the MoE reruns whole under "
             "op-level SAC, so it saves none of the GEMMs' rerun here. A mixer kind's own kernels rerun as its "
             "LayerTerms.partial_rerun says (GatedDeltaNet's: whole; attention's: saved)"),
}


# recompute=auto's default margin: the planner's largest measured under-estimate of torch's reserved peak
# was 2.6% (optimizer offload; every recompute setting, mix and sequence length within +-1.5% below,
# one H200, 2026-11-27, docs/benchmarks.md); 7% leaves more than twice that. framework.plan.preflight
# passes a plan silently up to the same fraction (MEASURED_UNDER; a test holds them equal).
MARGIN = 0.07


class _Recompute:
    """What every recompute policy shares: no option to check, and `apiary compare` holds a switch
    of policy to bitwise equality (recompute reruns the same forward ops in backward)."""

    NUMERICS = {"": "exact"}
    PLAN_CONSTANTS = PLAN_CONSTANTS

    @staticmethod
    def check(options, ctx) -> None:
        return None


class NoRecompute(_Recompute):
    @dataclass(kw_only=True)
    class Options:
        name: str = "none"
        """registry name (recompute=none)"""

    @staticmethod
    def apply(options, tc, ctx) -> None:
        tc.activation_checkpoint = None

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """Every saved activation kept; nothing rerun."""
        keep = {k: 1.0 for k in ctx.plan.counts}
        return PlanTerms(notes=["no extra compute"], facts=PlanFacts(keep=keep, inputs_only=False, forward_reruns=0))


class SelectiveRecompute(_Recompute):
    """Save expensive op outputs (matmuls, attention, collectives); recompute the rest."""

    @dataclass(kw_only=True)
    class Options:
        name: str = "selective"
        """registry name (recompute=selective)"""

    @staticmethod
    def apply(options, tc, ctx) -> None:
        from torchtitan.distributed.activation_checkpoint import SelectiveAC  # reason: start-up time

        tc.activation_checkpoint = SelectiveAC.Config()

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """Keeps each layer kind's ``selective_keep`` of its saved activations (norm inputs, the
        residual stream, all of them) and reruns ``selective_recompute_fraction`` of the forward GEMMs
        and each mixer kind's ``partial_rerun`` of its own forward (kernels off the save list rerun;
        the collectives' outputs are saved: no traffic rerun)."""
        c, layers = ctx.plan.constants, ctx.plan.layers
        keep = _selective_keep(ctx)
        extra = c.selective_recompute_fraction / 3  # of fwd + bwd = 3 x fwd
        mixers = {m: float(layers[m].partial_rerun) / 3 for m in _mixers(ctx)}
        rerun = ", ".join(f"{m} x {3 * v:g}" for m, v in mixers.items())
        return PlanTerms(extra_compute={"dense": extra, "experts": extra, **{m: v for m, v in mixers.items() if v}},
                         notes=[f"+{c.selective_recompute_fraction:g} of forward GEMMs"
                                + (f"; mixers' own forward rerun: {rerun}" if rerun else "")],
                         facts=PlanFacts(keep=keep, inputs_only=False, forward_reruns=0))


class FullRecompute(_Recompute):
    """Keep only each block's input; rerun the whole block in backward."""

    @dataclass(kw_only=True)
    class Options:
        name: str = "full"
        """registry name (recompute=full)"""

    @staticmethod
    def apply(options, tc, ctx) -> None:
        from torchtitan.distributed.activation_checkpoint import FullAC  # reason: start-up time

        tc.activation_checkpoint = FullAC.Config()

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """Keeps block inputs only; one more forward of every block (its collectives included)."""
        keep = {k: 0.0 for k in ctx.plan.counts}
        return PlanTerms(extra_compute={k: 1 / 3 for k in ("dense", "experts", *_mixers(ctx))},
                         notes=["+1 forward of every block (+1/3 of block FLOPs)"],
                         facts=PlanFacts(keep=keep, inputs_only=True, forward_reruns=1))


def _mixers(ctx) -> list[str]:
    """The model's mixer layer kinds (framework/contracts/plan.py LayerTerms, role "mixer")."""
    return [k for k, t in ctx.plan.layers.items() if t.role == "mixer"]


def _ffn(ctx) -> str | None:
    """The FFN layer kind of the model's blocks on this stage (the one with the most saves)."""
    counts, layers = ctx.plan.counts, ctx.plan.layers
    ffns = [k for k, t in layers.items() if t.role == "ffn" and counts.get(k, 0) > 0]
    return max(ffns, key=lambda k: layers[k].saved_per_token, default=None)


def _selective_keep(ctx) -> dict[str, float]:
    """Each layer kind's ``selective_keep`` (norm inputs: all)."""
    keep = {k: float(t.partial_keep) for k, t in ctx.plan.layers.items()}
    return {**{k: keep.get(k, 0.5) for k in ctx.plan.counts}, "norms": 1.0}


def _block_flops(ctx, mixer: str, ffn: str | None) -> float:
    """Forward FLOPs per token of one block with this mixer (orders the blocks auto keeps first:
    the time a block's recompute costs per byte its activations take)."""
    layers = ctx.plan.layers
    return (layers[ffn].forward_flops_per_token if ffn else 0.0) + layers[mixer].forward_flops_per_token


class AutoRecompute(_Recompute):
    """Per block: keep its activations, recompute it selectively or fully, as the planned peak
    allows. The candidates run from every block fully recomputed to every block kept, each step
    the one with the most forward time saved per byte it adds to the planned peak (kept blocks go
    last in the stage, where they cost least: ``per_layer_words``); the planner takes the last that
    fits the GPU less ``margin`` (framework/plan/planner/estimate.choose_candidate) and resolve hands the
    choice to ``apply`` (``ctx.derived["recompute"]``, with the cheaper candidates, nearest first). No
    GPU known: full recompute. At run time a step with allocator retries (after the warm-up) moves the
    run to the next cheaper candidate (per_block.Fallback); a resume of the same plan starts there."""

    @dataclass(kw_only=True)
    class Options:
        name: str = "auto"
        """registry name (recompute=auto)"""
        margin: float = MARGIN
        """fraction of the GPU's memory left unplanned (the planner's measured under-estimate, with room)"""
        budget_gib: Optional[float] = None
        """plan for this much memory instead of the GPU's (GiB; on a CPU run without CUDA context or NCCL)"""

        def __post_init__(self):
            if not 0 <= self.margin < 0.5:
                raise ValueError(f"recompute.margin must be in [0, 0.5), got {self.margin}")
            if self.budget_gib is not None and not self.budget_gib > 0:
                raise ValueError(f"recompute.budget_gib must be > 0, got {self.budget_gib}")

    @staticmethod
    def memory_budget(options) -> Optional[float]:
        """Plans by memory budget: ``budget_gib`` (GiB), None for the run's GPU."""
        return options.budget_gib if options is not None else None

    @staticmethod
    def check(options, ctx) -> None:
        if ctx.layout is not None and ctx.layout.pp > 1:
            raise ValueError("recompute=auto plans one pipeline stage; with parallel.pp > 1 choose "
                             "recompute=none, selective or full")

    @staticmethod
    def apply(options, tc, ctx) -> None:
        from components.recompute.per_block import per_block_config  # reason: start-up time (torchtitan)

        choice = ctx.derived.get("recompute") or {}
        tc.activation_checkpoint = per_block_config(choice.get("blocks"), getattr(ctx.facts, "layer_mixers", ()),
                                                    ctx.facts.n_layers, choice.get("fallbacks"),
                                                    planned=choice.get("planned") or choice.get("blocks"),
                                                    taken=int(choice.get("fallbacks_taken") or 0))

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        c, counts = ctx.plan.constants, ctx.plan.counts
        margin = opts.margin if opts is not None else MARGIN
        budget = int(opts.budget_gib * 2**30) if opts is not None and opts.budget_gib else None
        keep_sel = _selective_keep(ctx)
        n = {m: int(round(counts.get(m, 0))) for m in _mixers(ctx) if counts.get(m, 0)}
        ffn = _ffn(ctx)
        words = [w for w in POLICY_OF if w != "ffn_rerun" or ffn]
        state = {m: {**{w: 0 for w in words}, "recomputed": k} for m, k in n.items()}
        mixers, n_layers = tuple(getattr(ctx.facts, "layer_mixers", ()) or ()), int(ctx.facts.n_layers)
        mixers = mixers or ("attention",) * n_layers
        saves = block_saves(ctx.plan.saved, ctx.plan.layers, keep_sel, float(ctx.facts.dim), ffn)
        s = c.selective_recompute_fraction
        f_ffn = ctx.plan.layers[ffn].forward_flops_per_token if ffn else 0.0
        # forward FLOPs per token backward reruns in one block, by what the block keeps
        rerun = {m: {"recomputed": _block_flops(ctx, m, ffn), "partial": s * _block_flops(ctx, m, ffn),
                     "ffn_rerun": f_ffn, "kept": 0.0} for m in n}

        def order() -> list[tuple[str, str]]:
            return list(zip(mixers, per_layer_words(state, mixers, n_layers)))

        def activation_elements() -> float:  # the stage's peak of saves and reruns, per token
            return stage_activation_elements([saves[m][w] for m, w in order() if m in n])[1]

        def terms() -> PlanTerms:
            total = sum(n.values()) or 1
            share = {w: sum(state[m][w] for m in n) / total for w in words}
            # the mixer's own compute reruns with the whole block; the FFN's (experts, dense) also
            # when only the FFN is rerun
            extra = {m: (state[m]["recomputed"] + s * state[m]["partial"]) / max(1, n[m]) / 3 for m in n}
            extra.update({k: (share["recomputed"] + s * share["partial"] + share.get("ffn_rerun", 0.0)) / 3
                          for k in ("dense", "experts")})
            desc = "; ".join(f"{m}: {state[m]['kept']} kept, " + (f"{state[m]['ffn_rerun']} FFN rerun, " if ffn else "")
                             + f"{state[m]['partial']} selective, {state[m]['recomputed']} full" for m in n)
            return PlanTerms(extra_compute=extra, notes=[f"auto per block ({desc})"],
                             facts=PlanFacts(blocks={m: dict(v) for m, v in state.items()}, keep=keep_sel,
                                             layers=order(), forward_reruns=share["recomputed"], fit_margin=margin,
                                             budget_bytes=budget or None))

        # a block goes one step at a time (through keeping its mixer, where it has an FFN), so the
        # candidates grow in small steps and the last that fits leaves little memory unused
        steps = ((("recomputed", "ffn_rerun"), ("ffn_rerun", "kept")) if ffn else (("recomputed", "kept"),)) \
            + (("recomputed", "partial"), ("partial", "kept"))
        chain = [terms()]
        while True:
            now, moves = activation_elements(), []
            for m in n:
                for src, dst in steps:
                    gain = rerun[m][src] - rerun[m][dst]
                    if gain <= 0 or not state[m][src]:
                        continue
                    state[m][src] -= 1
                    state[m][dst] += 1
                    cost = activation_elements() - now
                    state[m][src] += 1
                    state[m][dst] -= 1
                    # the most rerun time saved per element added (a free move first, the larger gain first)
                    moves.append((gain / cost if cost > 0 else float("inf"), gain, m, src, dst))
            if not moves:
                break
            *_, m, src, dst = max(moves)
            state[m][src] -= 1
            state[m][dst] += 1
            chain.append(terms())
        first = chain[0]
        return replace(first, facts=replace(first.facts, candidates=chain))
