"""Expert-parallel chunk policies: how a MoE layer's local tokens are split to overlap
dispatch/combine with expert compute.

The moe_chunk protocol: ``apply(model_config)`` edits a torchtitan model config before it is
built. ``Chunked(n)`` and ``AutoChunk`` swap every ``RoutedExperts`` config for
``components.moe.chunked_experts.ChunkedRoutedExperts`` (same parameters and state-dict keys);
the router, its load-balancing statistics and the shared experts are untouched. The schedule
itself is documented in components/moe/chunked_experts.py and docs/skills/moe_chunk.md.

The ``auto`` rule (``auto_num_chunks`` and its constants) lives in components.moe.auto_chunks.
"""

from __future__ import annotations

from components.moe.auto_chunks import AUTO_MIN_EP  # noqa: F401  (framework/planner.py reads it from here)
from components.moe.chunked_experts import use_chunked_experts
from framework.errors import UserError
from framework.contracts import PlanTerms


def _check_comm(where: str, comm_backend: str) -> None:
    """Chunking runs on torchtitan's standard all-to-all dispatcher only."""
    if comm_backend != "standard":
        raise UserError(where, f"chunked EP overlap needs the standard all-to-all dispatcher (moe.comm=alltoall), "
                               f"not torchtitan backend {comm_backend!r}.", "Use moe.chunk=none with this moe.comm.")


class NoChunk:
    """One dispatch -> grouped GEMM -> combine per MoE layer (the baseline)."""

    @staticmethod
    def apply(model_config) -> None:
        return None

    @staticmethod
    def check(comm_backend: str, where: str = "moe.chunk=none") -> None:
        return None

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """One chunk; the all-to-all hides ``ep_overlap.none`` under compute."""
        return PlanTerms(facts={"chunks": 1, "overlap": "none"})

    # apiary compare: how runs differing in this component or its options are held to each other
    # (chunking reschedules dispatch/combine around the same expert GEMMs).
    NUMERICS = {"": "exact"}


class Chunked:
    """Split each MoE layer's local tokens into ``num_chunks`` chunks with an overlapped
    dispatch / grouped-GEMM / combine schedule (forward and backward)."""

    def __init__(self, num_chunks: int):
        if num_chunks < 2:
            raise ValueError(f"Chunked needs at least 2 chunks, got {num_chunks} (use NoChunk)")
        self.num_chunks = num_chunks

    def apply(self, model_config) -> None:
        use_chunked_experts(model_config, self.num_chunks)

    def check(self, comm_backend: str, where: str | None = None) -> None:
        """Before any worker starts: refuse dispatchers this policy cannot chunk (UserError)."""
        _check_comm(where or f"moe.chunk=chunk{self.num_chunks}", comm_backend)

    def __repr__(self) -> str:
        return f"Chunked({self.num_chunks})"

    def plan_terms(self, opts, ctx) -> PlanTerms:
        """Dispatch/combine buffers per chunk; the all-to-all hides ``ep_overlap.chunkN``."""
        return PlanTerms(facts={"chunks": self.num_chunks, "overlap": f"chunk{self.num_chunks}"})

    # apiary compare: how runs differing in this component or its options are held to each other
    # (chunking reschedules dispatch/combine around the same expert GEMMs).
    NUMERICS = {"": "exact"}


class AutoChunk:
    """Chunk count chosen per forward by ``components.moe.auto_chunks.auto_num_chunks`` (local
    tokens, EP size, GEMM rows)."""

    @staticmethod
    def apply(model_config) -> None:
        use_chunked_experts(model_config, None)

    @staticmethod
    def check(comm_backend: str, where: str = "moe.chunk=auto") -> None:
        _check_comm(where, comm_backend)

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """Planned as 2 chunks of buffers; below ``AUTO_MIN_EP`` auto runs unchunked, so its
        all-to-all is planned as the unchunked one's (``ep_overlap.none``), else ``ep_overlap.auto``."""
        return PlanTerms(facts={"chunks": 2, "overlap": "none" if ctx.layout.ep < AUTO_MIN_EP else "auto"})

    # apiary compare: how runs differing in this component or its options are held to each other
    # (chunking reschedules dispatch/combine around the same expert GEMMs).
    NUMERICS = {"": "exact"}


# registry.yaml targets: components.moe.chunk:chunk2 / chunk3 / chunk4 / AutoChunk
chunk2 = Chunked(2)
chunk3 = Chunked(3)
chunk4 = Chunked(4)
