"""Baseline loss: materialised logits [tokens, vocab] and fp32 cross-entropy (torchtitan's)."""

from __future__ import annotations

from dataclasses import dataclass


def check_data(name: str, needs: tuple[str, ...], ctx) -> None:
    """The recipe's data kind is one this loss trains on (ValueError: the reason)."""
    fmt = ctx.choice("data")
    if fmt not in needs:
        raise ValueError(f"loss={name} trains on data.format={'|'.join(needs)}, not {fmt}")


class CrossEntropy:
    NEEDS_DATA = ("text", "rollouts")

    @dataclass(kw_only=True)
    class Options:
        name: str = "ce"
        """registry name (loss=ce)"""

    @staticmethod
    def check(options: "CrossEntropy.Options", ctx) -> None:
        check_data(options.name, CrossEntropy.NEEDS_DATA, ctx)

    @staticmethod
    def apply(options: "CrossEntropy.Options", tc, ctx) -> None:
        from torchtitan.components.loss import CrossEntropyLoss  # reason: torchtitan after devices.install

        tc.loss = CrossEntropyLoss.Config(global_vocab_size=ctx.facts.vocab_size)
