"""Baseline loss: materialised logits [tokens, vocab] and fp32 cross-entropy (torchtitan's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from framework.contracts import PlanConstant, PlanFacts, PlanTerms, Term

# the planner's constants of the materialised-logits losses (ce, chunked, ce_zloss); calibrate as
# `apiary plan calib.NAME=VALUE` (docs/skills/planner.md)
PLAN_CONSTANTS = {
    "ce_logits_bytes": PlanConstant(2.0, "ce: bf16 lm_head output [tokens, vocab/TP]."),
    "ce_fp32_bytes": PlanConstant(4.0, "ce: fp32 logits (or log-softmax output) [tokens, vocab/TP] (seed 000: "
                                       "65,536 x 124,160 x 4 = 32.55 GB)."),
    "ce_grad_bytes": PlanConstant(4.0, "ce: fp32 gradient of the logits [tokens, vocab/TP] in backward."),
    "loss_time_factor": PlanConstant(
        {"ce": 1.65},
        "loss layer time over its 3 GEMMs alone, by loss (FACTS, one H200, V=248,320, "
        "32K tokens: naive 1.68x, torch chunked 1.66x, Liger/Cut-CE 1.24-1.25x)."),
}


def check_data(name: str, needs: tuple[str, ...], ctx) -> None:
    """The recipe's data kind is one this loss trains on (ValueError: the reason)."""
    fmt = ctx.choice("data")
    if fmt not in needs:
        raise ValueError(f"loss={name} trains on data.format={'|'.join(needs)}, not {fmt}")


class CrossEntropy:
    NEEDS_DATA = ("text", "rollouts")
    PLAN_CONSTANTS = PLAN_CONSTANTS

    @dataclass(kw_only=True)
    class Options:
        name: str = "ce"
        """registry name (loss=ce)"""

    @staticmethod
    def check(options: "CrossEntropy.Options", ctx) -> None:
        check_data(options.name, CrossEntropy.NEEDS_DATA, ctx)

    @staticmethod
    def apply(options: "CrossEntropy.Options", tc, ctx) -> None:
        from torchtitan.components.loss import CrossEntropyLoss  # reason: start-up time (torchtitan)

        tc.loss = CrossEntropyLoss.Config(global_vocab_size=ctx.facts.vocab_size)

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """bf16 logits, their fp32 copy and fp32 gradient for every local token (the planner's
        ``ce_*_bytes``); the loss layer's time over its GEMMs: ``loss_time_factor.ce``."""
        T = ctx.plan.tokens
        return logits_plan_terms(ctx, int(T), f"{T:,.0f} tokens", "ce")

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another kernel of the same cross-entropy).
    NUMERICS = {"": "dtype"}


def logits_plan_terms(ctx, rows: int, how: str, time_key: str) -> PlanTerms:
    """Materialised logits of ``rows`` tokens over the TP-split vocabulary (ce and chunked)."""
    c, tp = ctx.plan.constants, ctx.layout.tp
    cols = math.ceil(ctx.facts.vocab_size / tp)
    return PlanTerms(
        memory=[Term("logits_bf16", rows * cols, c.ce_logits_bytes, "loss",
                     f"{how} x vocab/TP {cols:,} x {c.ce_logits_bytes:g} B"),
                Term("logits_fp32", rows * cols, c.ce_fp32_bytes, "loss",
                     f"{how} x vocab/TP {cols:,} x {c.ce_fp32_bytes:g} B"),
                Term("logits_grad", rows * cols, c.ce_grad_bytes, "loss",
                     f"{how} x vocab/TP {cols:,} x {c.ce_grad_bytes:g} B")],
        time_factor={"lm_head": float(c.loss_time_factor.get(time_key, c.loss_time_factor.get("ce", 1.65)))},
        facts=PlanFacts(objective="cross_entropy", summary="materialised logits"))
