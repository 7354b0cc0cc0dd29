"""Baseline loss: materialised logits [tokens, vocab] and fp32 cross-entropy (torchtitan's)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.loss import CrossEntropyLoss


class CrossEntropy:
    @dataclass
    class Options:
        name: str = "ce"

    @staticmethod
    def trainer_loss(opts: "CrossEntropy.Options", vocab_size: int):
        return CrossEntropyLoss.Config(global_vocab_size=vocab_size)
