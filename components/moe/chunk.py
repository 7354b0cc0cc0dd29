"""Expert-parallel chunk policies: how a MoE layer's local tokens are split to overlap
dispatch/combine with expert compute."""

from __future__ import annotations


class NoChunk:
    """One dispatch -> grouped GEMM -> combine per MoE layer (the baseline)."""

    @staticmethod
    def apply(model_config) -> None:
        return None
