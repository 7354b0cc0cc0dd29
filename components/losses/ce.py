"""Baseline loss: materialised logits [tokens, vocab] and fp32 cross-entropy (torchtitan's)."""

from __future__ import annotations

from dataclasses import dataclass


class CrossEntropy:
    @dataclass
    class Options:
        name: str = "ce"

    @staticmethod
    def trainer_loss(opts: "CrossEntropy.Options", vocab_size: int):
        from torchtitan.components.loss import CrossEntropyLoss

        return CrossEntropyLoss.Config(global_vocab_size=vocab_size)

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another kernel of the same cross-entropy).
    NUMERICS = {"": "dtype"}
