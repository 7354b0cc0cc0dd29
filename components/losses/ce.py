"""Baseline loss: materialised logits [tokens, vocab] and fp32 cross-entropy (torchtitan's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan.components.loss import CrossEntropyLoss
from framework.contracts import PlanTerms, Term


class CrossEntropy:
    @dataclass
    class Options:
        name: str = "ce"

    @staticmethod
    def trainer_loss(opts: "CrossEntropy.Options", vocab_size: int):
        return CrossEntropyLoss.Config(global_vocab_size=vocab_size)

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
        facts={"objective": "cross_entropy", "summary": "materialised logits"})
