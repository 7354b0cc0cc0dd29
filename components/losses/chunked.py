"""Chunked cross-entropy: torchtitan's ChunkedLossWrapper runs lm_head + CE per sequence
chunk with an immediate backward, so only [tokens / num_chunks, vocab] logits live at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from components.losses import ce
from components.losses.ce import check_data, logits_plan_terms
from framework.contracts import PlanConstant, PlanTerms

# the planner's constants (ce's logits bytes, and its own); calibrate as `apiary plan calib.NAME=VALUE`
PLAN_CONSTANTS = {
    **ce.PLAN_CONSTANTS,
    "chunked_num_chunks": PlanConstant(8, "chunked: chunks when the recipe's loss does not say (torchtitan "
                                          "default 8)."),
    "loss_time_factor": PlanConstant(
        {"chunked": 1.70},
        "loss layer time over its 3 GEMMs alone, by loss (FACTS, one H200, V=248,320, "
        "32K tokens: naive 1.68x, torch chunked 1.66x, Liger/Cut-CE 1.24-1.25x)."),
}


class ChunkedCrossEntropy:
    NEEDS_DATA = ("text", "rollouts")
    PLAN_CONSTANTS = PLAN_CONSTANTS

    @dataclass(kw_only=True)
    class Options:
        name: str = "chunked"
        """registry name (loss=chunked)"""
        num_chunks: int = 8
        """sequence chunks per step; only [tokens / num_chunks, vocab] logits live at once"""

        def __post_init__(self):
            if self.num_chunks < 1:
                raise ValueError(f"loss.num_chunks must be >= 1 (chunks of the sequence per step), got {self.num_chunks}")

    @staticmethod
    def check(options: "ChunkedCrossEntropy.Options", ctx=None) -> None:
        """Called by resolve before anything starts (ValueError: the reason)."""
        if ctx is not None:
            check_data(options.name, ChunkedCrossEntropy.NEEDS_DATA, ctx)

    @staticmethod
    def apply(options: "ChunkedCrossEntropy.Options", tc, ctx) -> None:
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # reason: start-up time

        tc.loss = ChunkedLossWrapper.Config(
            num_chunks=options.num_chunks,
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=ctx.facts.vocab_size),
        )

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """ce's logits terms for one chunk of the local tokens (``chunked_num_chunks`` when the
        recipe's loss is not chunked); time ``loss_time_factor.chunked``."""
        T = ctx.plan.tokens
        n = int(getattr(opts, "num_chunks", 0) or 0) or int(ctx.plan.constants.chunked_num_chunks)
        return logits_plan_terms(ctx, math.ceil(T / n), f"{T:,.0f} tokens / {n} chunks", "chunked")

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another kernel of the same cross-entropy; num_chunks only reorders sums).
    NUMERICS = {"": "dtype"}
