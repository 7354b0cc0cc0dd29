"""Chunked cross-entropy: torchtitan's ChunkedLossWrapper runs lm_head + CE per sequence
chunk with an immediate backward, so only [tokens / num_chunks, vocab] logits live at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from components.losses.ce import logits_plan_terms
from framework.contracts import PlanTerms


class ChunkedCrossEntropy:
    @dataclass
    class Options:
        name: str = "chunked"
        num_chunks: int = 8

    @staticmethod
    def check(opts: "ChunkedCrossEntropy.Options") -> None:
        """Called by resolve before anything starts (ValueError: the reason)."""
        if opts.num_chunks < 1:
            raise ValueError(f"loss.num_chunks must be >= 1 (chunks of the sequence per step), got {opts.num_chunks}")

    @staticmethod
    def trainer_loss(opts: "ChunkedCrossEntropy.Options", vocab_size: int):
        ChunkedCrossEntropy.check(opts)
        return ChunkedLossWrapper.Config(
            num_chunks=opts.num_chunks,
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab_size),
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
