"""Cross-entropy plus a z-loss on materialised logits: the unfused partner of ``loss=linear_ce
loss.z_loss=C`` (the same objective, ``lse - s_y + C lse^2`` per token, from [tokens, vocab] logits).

This module is also the worked example of docs/architecture.md: a loss in one file, bound by one
line of registry.yaml, with docs/skills/ce_zloss.md and the paired test tests/test_ce_zloss.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from components.losses.ce import check_data, logits_plan_terms
from framework.contracts import PlanTerms


@cache
def loss_class():
    """The torchtitan loss class ``ZLossCrossEntropyLoss``, built on first use (it subclasses
    torchtitan's, so importing this module, as `train --help` does, loads no torchtitan)."""
    import spmd_types as spmd  # reason: start-up time (torch)
    import torch  # reason: start-up time
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss  # reason: start-up time (torchtitan)

    class ZLossCrossEntropyLoss(CrossEntropyLoss):
        """torchtitan's cross-entropy (sum over tokens, divided by the global valid-token count) plus
        ``z_loss`` x the same normalised sum of ``logsumexp(logits)^2`` over the valid tokens."""

        @dataclass(kw_only=True, slots=True)
        class Config(CrossEntropyLoss.Config):
            z_loss: float = 1e-4

        def __init__(self, config: Config, *, compile_config=None):
            super().__init__(config, compile_config=compile_config)
            self.z_loss = config.z_loss

        def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
            loss, extra = super().__call__(pred, labels, global_valid_tokens, **kwargs)
            if self.z_loss > 0:
                with spmd.no_typecheck():  # a partial sum over data/context shards, as torchtitan's CE
                    lse = torch.logsumexp(pred.float(), dim=-1)
                    z = torch.where(labels != IGNORE_INDEX, lse.square(), 0.0).sum()
                    if global_valid_tokens is not None:
                        z = z / global_valid_tokens
                    loss = loss + self.z_loss * z
            return loss, extra

    ZLossCrossEntropyLoss.__qualname__ = "ZLossCrossEntropyLoss"  # found by name (pickle): __getattr__ below
    ZLossCrossEntropyLoss.Config.__qualname__ = "ZLossCrossEntropyLoss.Config"
    return ZLossCrossEntropyLoss


def __getattr__(name: str):
    """``ZLossCrossEntropyLoss`` reads as a module attribute (``from ... import ZLossCrossEntropyLoss``)."""
    if name == "ZLossCrossEntropyLoss":
        return loss_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ZLossCrossEntropy:
    """Registry component (kind ``loss``), see framework/contracts/protocols.py."""

    NEEDS_DATA = ("text",)

    @dataclass(kw_only=True)
    class Options:
        name: str = "ce_zloss"
        """registry name (loss=ce_zloss)"""
        z_loss: float = 1e-4
        """coefficient of logsumexp(logits)^2 per token (0: plain cross-entropy)"""

        def __post_init__(self):
            if not self.z_loss >= 0:
                raise ValueError(f"loss.z_loss must be >= 0, got {self.z_loss}")

    @staticmethod
    def check(options: "ZLossCrossEntropy.Options", ctx) -> None:
        check_data(options.name, ZLossCrossEntropy.NEEDS_DATA, ctx)
        if ctx.layout is not None and ctx.layout.tp > 1:
            raise ValueError("loss=ce_zloss needs parallel.tp=1 (its logsumexp reads the whole vocabulary row); "
                             "with TP use loss=linear_ce loss.z_loss=C")

    @staticmethod
    def apply(options: "ZLossCrossEntropy.Options", tc, ctx) -> None:
        tc.loss = loss_class().Config(global_vocab_size=ctx.facts.vocab_size, z_loss=options.z_loss)

    @staticmethod
    def plan_terms(options, ctx) -> PlanTerms:
        """ce's materialised-logits terms; its own objective, so `apiary plan --search` never swaps it
        for plain cross-entropy."""
        T = ctx.plan.tokens
        terms = logits_plan_terms(ctx, int(T), f"{T:,.0f} tokens", "ce")
        terms.facts.objective = "cross_entropy+z_loss"
        return terms

    # apiary compare: plain cross-entropy and another z_loss are other objectives (compare cannot
    # see that a linear_ce variant has the same z_loss, so a switch of loss is held to nothing)
    NUMERICS = {"": "any", "z_loss": "any"}
