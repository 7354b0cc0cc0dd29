"""``publish.transport=hf_folder`` (the baseline): every version is an HF folder (framework/train/publish.py)."""

from __future__ import annotations

from components.transport.vllm import PublishOptions
from framework.contracts import PlanTerms


class HFFolder:
    """HF folders in publish.dir, a `latest` pointer; any generator reloads them from disk."""

    Options = PublishOptions
    IN_MEMORY = False
    SKILL = "transport"
    # apiary compare: the trained weights are the same whichever way they are handed over
    NUMERICS = {"": "exact"}

    @staticmethod
    def check(options, ctx=None) -> None:
        return None

    @staticmethod
    def apply(options, tc, ctx=None) -> None:
        return None

    @staticmethod
    def plan_terms(options, ctx) -> PlanTerms:
        """Nothing on the GPU: a folder's tensors are gathered one at a time onto the host."""
        return PlanTerms()

    @staticmethod
    def sender(options, settings, trainer):
        """No in-memory sender: framework/train/publish.py writes the folders."""
        return None
