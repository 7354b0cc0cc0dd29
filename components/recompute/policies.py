"""Activation recompute policies: torchtitan's activation checkpointing per block."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from framework.contracts import PlanTerms


class _Recompute:
    """What every recompute policy shares: no option to check, and `apiary compare` holds a switch
    of policy to bitwise equality (recompute reruns the same forward ops in backward)."""

    NUMERICS = {"": "exact"}

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
        return PlanTerms(notes=["no extra compute"], facts={"keep": keep, "inputs_only": False, "forward_reruns": 0})


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
        """Keeps ``selective_keep`` of each layer kind's saved activations (norm inputs, the
        residual stream, all of them) and reruns ``selective_recompute_fraction`` of the forward GEMMs."""
        c = ctx.plan.constants
        keep = {k: float(c.selective_keep.get(k, 0.5)) for k in ctx.plan.counts}
        keep["norms"] = 1.0
        extra = c.selective_recompute_fraction / 3  # of fwd + bwd = 3 x fwd
        return PlanTerms(extra_compute={"dense": extra, "experts": extra},
                         notes=[f"+{c.selective_recompute_fraction:g} of forward GEMMs"],
                         facts={"keep": keep, "inputs_only": False, "forward_reruns": 0})


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
        return PlanTerms(extra_compute={k: 1 / 3 for k in ("dense", "experts", "attention", "linear_attention")},
                         notes=["+1 forward of every block (+1/3 of block FLOPs)"],
                         facts={"keep": keep, "inputs_only": True, "forward_reruns": 1})


_MIXERS = ("attention", "linear_attention")


def _block_flops(ctx, mixer: str) -> float:
    """Forward FLOPs per token of one block with this mixer (orders the blocks auto keeps first:
    the time a block's recompute costs per byte its activations take)."""
    f, seq = ctx.facts, float(ctx.cfg.training.seq_len)
    d, q, kv = f.dim, f.n_heads * f.head_dim, f.n_kv_heads * f.head_dim
    ffn = 2 * (f.top_k * 3 * d * f.moe_hidden_dim + 3 * d * f.shared_expert_hidden_dim) if f.num_experts \
        else 2 * 3 * d * f.ffn_hidden_dim
    if mixer == "attention":  # projections (q with its gate), then QK^T and PV over a causal context
        return ffn + 2 * (d * (2 * q + 2 * kv) + q * d) + 2 * seq * q
    la = f.linear_attn or {}
    kd, vd, hv = la.get("key_dim", q), la.get("value_dim", q), la.get("value_heads", f.n_heads)
    return ffn + 2 * (d * (2 * kd + 2 * vd) + vd * d) + 4 * (kd / max(1, la.get("key_heads", hv))) * vd


class AutoRecompute(_Recompute):
    """Per block: keep its activations, recompute it selectively or fully, as the planned peak
    allows. The candidates run from every block fully recomputed to every block kept, each step
    the one with the most forward time saved per byte kept; the planner takes the last that fits
    the GPU less ``margin`` (framework/planner/estimate.choose_candidate) and resolve hands the
    choice to ``apply`` (``ctx.derived["recompute"]``). No GPU known: full recompute."""

    @dataclass(kw_only=True)
    class Options:
        name: str = "auto"
        """registry name (recompute=auto)"""
        margin: float = 0.10
        """fraction of the GPU's memory left unplanned (the planner's measured error)"""
        budget_gib: Optional[float] = None
        """plan for this much GPU memory instead of the GPU's (GiB; also chooses on a GPU-less machine)"""

        def __post_init__(self):
            if not 0 <= self.margin < 0.5:
                raise ValueError(f"recompute.margin must be in [0, 0.5), got {self.margin}")
            if self.budget_gib is not None and not self.budget_gib > 0:
                raise ValueError(f"recompute.budget_gib must be > 0, got {self.budget_gib}")

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
                                                    ctx.facts.n_layers)

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        c, counts = ctx.plan.constants, ctx.plan.counts
        margin = opts.margin if opts is not None else 0.10
        budget = int(opts.budget_gib * 2**30) if opts is not None and opts.budget_gib else None
        keep_sel = {k: float(c.selective_keep.get(k, 0.5)) for k in counts}
        n = {m: int(round(counts.get(m, 0))) for m in _MIXERS if counts.get(m, 0)}
        state = {m: {"kept": 0, "partial": 0, "recomputed": k} for m, k in n.items()}
        saved, dim = ctx.plan.saved, float(ctx.facts.dim)
        ffn = "moe" if counts.get("moe") else "mlp"
        fit = c.saved_activation_factor
        elems = {m: {"kept": (saved[m] + saved[ffn] + saved["norms"])
                     * float(fit.get(f"{m}+{ffn}", 1.0) if isinstance(fit, dict) else fit),
                     "partial": saved[m] * keep_sel[m] + saved[ffn] * keep_sel[ffn] + saved["norms"],
                     "recomputed": dim} for m in n}
        flops = {m: _block_flops(ctx, m) for m in n}
        s = c.selective_recompute_fraction
        rerun = {"recomputed": 1.0, "partial": s, "kept": 0.0}  # forward of the block rerun, as a fraction

        def terms() -> PlanTerms:
            total = sum(n.values()) or 1
            frac = {p: sum(state[m][p] for m in n) / total for p in ("kept", "partial", "recomputed")}
            extra = {m: (state[m]["recomputed"] + s * state[m]["partial"]) / max(1, n[m]) / 3 for m in n}
            extra.update({k: (frac["recomputed"] + s * frac["partial"]) / 3 for k in ("dense", "experts")})
            desc = "; ".join(f"{m}: {state[m]['kept']} kept, {state[m]['partial']} selective, "
                             f"{state[m]['recomputed']} full" for m in n)
            return PlanTerms(extra_compute=extra, notes=[f"auto per block ({desc})"],
                             facts={"blocks": {m: dict(v) for m, v in state.items()}, "keep": keep_sel,
                                    "forward_reruns": frac["recomputed"], "margin": margin,
                                    **({"budget_bytes": budget} if budget else {})})

        chain = [terms()]
        while True:
            moves = []
            for m in n:
                for src, dst in (("recomputed", "kept"), ("recomputed", "partial"), ("partial", "kept")):
                    cost = elems[m][dst] - elems[m][src]
                    if state[m][src] and cost > 0:
                        moves.append(((rerun[src] - rerun[dst]) * flops[m] / cost, m, src, dst))
            if not moves:
                break
            _, m, src, dst = max(moves)
            state[m][src] -= 1
            state[m][dst] += 1
            chain.append(terms())
        first = chain[0]
        return replace(first, facts={**first.facts, "candidates": chain})
