"""Activation recompute policies: torchtitan's activation checkpointing per block."""

from __future__ import annotations

from dataclasses import dataclass

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
