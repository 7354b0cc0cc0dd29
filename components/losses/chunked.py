"""Chunked cross-entropy: torchtitan's ChunkedLossWrapper runs lm_head + CE per sequence
chunk with an immediate backward, so only [tokens / num_chunks, vocab] logits live at once."""

from __future__ import annotations

from dataclasses import dataclass

from components.losses.ce import check_data


class ChunkedCrossEntropy:
    NEEDS_DATA = ("text", "rollouts")

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
        type(options).__post_init__(options)
        if ctx is not None:
            check_data(options.name, ChunkedCrossEntropy.NEEDS_DATA, ctx)

    @staticmethod
    def apply(options: "ChunkedCrossEntropy.Options", tc, ctx) -> None:
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # reason: after devices.install

        tc.loss = ChunkedLossWrapper.Config(
            num_chunks=options.num_chunks,
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=ctx.facts.vocab_size),
        )
