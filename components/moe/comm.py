"""Expert-parallel token dispatch/combine backends (names bound in registry.yaml)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from framework.contracts import PlanTerms, Term
from framework.errors import UserError


@dataclass(kw_only=True)
class MoeOptions:
    """The recipe's ``moe:`` section as the ``moe_comm`` and ``moe_chunk`` kinds read it. Its keys,
    their types, defaults and docs are framework/compose/schema.py's MoEConfig, their one definition:
    ``contracts.make_options`` builds this class over it (comm, chunk, load_balance_coeff, ...)."""


class _Comm:
    Options = MoeOptions
    torchtitan_backend = ""

    @staticmethod
    def check(options, ctx=None) -> None:
        return None

    @staticmethod
    def apply(options, tc, ctx=None) -> None:
        """Nothing to edit: the model family passes ``torchtitan_backend`` to its model config."""
        return None

    @staticmethod
    def plan_terms(options, ctx) -> PlanTerms:
        """Nothing beyond the dispatch/combine buffers the planner counts from the model's shapes."""
        return PlanTerms()


class AllToAll(_Comm):
    """torch all_to_all_single with a host sync on the split sizes (torchtitan 'standard')."""

    torchtitan_backend = "standard"

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another dispatch/combine backend).
    NUMERICS = {"": "dtype"}


@dataclass(kw_only=True)
class DeepEPOptions(MoeOptions):
    """``moe:`` with moe.comm=deepep: the package is checked as the options are read, before the
    model is sized (torchtitan's DeepEP dispatcher cannot even be configured without it)."""

    def __post_init__(self):
        DeepEP.check()


class DeepEP(_Comm):
    """DeepEP >= 2 (deep_ep.ElasticBuffer) kernels through torchtitan's 'deepep' backend.

    Needs CUDA, EP > 1 and DeepEP built from source (docs/install.md, scripts/build_deepep.sh); asking
    for it without them is a user error at resolve time, before any worker starts.

    torchtitan sizes one process-wide ElasticBuffer from the training shape (its
    ``update_ep_token_dispatcher_config``: local_batch x seq_len / (CP x TP) tokens per rank, the
    model's dim, top-k) and creates it when the EP mesh is wired (``DeepEPTokenDispatcher.init_buffer``).
    DeepEP allocates it as NCCL symmetric memory, outside torch's caching allocator: ``plan_terms``
    counts it as such (``buffer_bytes``).
    """

    torchtitan_backend = "deepep"
    Options = DeepEPOptions

    @staticmethod
    def check(options=None, ctx=None) -> None:
        try:
            import deep_ep  # reason: optional dependency (CUDA builds only)
        except ImportError:
            raise UserError("moe.comm=deepep", "the deep_ep package is not installed.",
                            "Build DeepEP >= 2 from source (docs/install.md), or use moe.comm=alltoall.") from None
        if not hasattr(deep_ep, "ElasticBuffer"):
            raise UserError("moe.comm=deepep", f"deep_ep {getattr(deep_ep, '__version__', '?')} has no "
                            "ElasticBuffer; torchtitan's deepep backend needs DeepEP >= 2.",
                            "Rebuild DeepEP from its current source, or use moe.comm=alltoall.")
        if ctx is None or ctx.layout is None or ctx.facts is None or not getattr(ctx.facts, "num_experts", 0):
            return  # options time, or a dense model (no dispatcher is built)
        if ctx.layout.ep <= 1:  # torchtitan raises on every rank at model build otherwise
            raise UserError("moe.comm=deepep", "dispatches tokens between expert-parallel ranks, and this layout "
                            "has EP 1 (torchtitan's DeepEP dispatcher requires expert_parallel_degree > 1).",
                            "Use parallel.ep=2 or more, or moe.comm=alltoall.")
        seq, shards = int(ctx.cfg.training.seq_len), ctx.layout.cp * ctx.layout.tp
        if seq % shards:
            raise UserError(f"training.seq_len={seq}", f"must divide by CP x TP = {shards} with moe.comm=deepep: "
                            "DeepEP's buffer is sized for equal token counts per rank.",
                            f"Use a multiple of {shards}.")

    @staticmethod
    def apply(options, tc, ctx=None) -> None:
        """DeepEP's environment, in this rank's process before the buffer is created (each only when unset):
        ``EP_DISABLE_GIN=1`` when every EP rank is on this node (NVLink only: no NCCL GIN/RDMA, which a
        machine without an RDMA NIC refuses), ``EP_REUSE_NCCL_COMM=0`` (DeepEP makes its own NCCL
        communicator rather than reuse torch's, which may not exist yet when the buffer is created).
        torchtitan's qwen3_moe_deepep config names both for hosts without an RDMA NIC."""
        for key, value in DeepEP.environment(ctx).items():
            os.environ.setdefault(key, value)

    @staticmethod
    def environment(ctx=None) -> dict[str, str]:
        env = {"EP_REUSE_NCCL_COMM": "0"}
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        ep = ctx.layout.ep if ctx is not None and ctx.layout is not None else 0
        if ep and per_node and ep <= per_node:
            env["EP_DISABLE_GIN"] = "1"
        return env

    @staticmethod
    def plan_terms(options, ctx) -> PlanTerms:
        """DeepEP's ElasticBuffer: one per process (every MoE layer shares it), outside torch's allocator."""
        f, lay = ctx.facts, ctx.layout
        if f is None or lay is None or not f.num_experts or lay.ep <= 1:
            return PlanTerms()
        tokens = int(ctx.cfg.training.local_batch) * int(ctx.cfg.training.seq_len) // (lay.cp * lay.tp)
        per_node = int(getattr(ctx.plan.constants, "gpus_per_node", 8)) if ctx.plan is not None else 8
        n = buffer_bytes(tokens, f.dim, f.top_k, lay.ep, per_node)
        how = (f"DeepEP ElasticBuffer: {tokens:,} tokens/rank (local_batch x seq / (CP x TP)), dim {f.dim}, "
               f"top-k {f.top_k}, EP {lay.ep}; bf16 dispatch, max(dispatch, combine) layout + workspace, "
               "2 MiB-aligned (NCCL symmetric memory, outside torch's allocator)")
        return PlanTerms(memory=[Term("deepep_buffer", 1, n, "outside", how)],
                         notes=[f"moe.comm=deepep: a {n / 2**30:.2f} GiB DeepEP buffer per GPU, outside torch's "
                                "allocator (not in torch max reserved)"])

    # apiary compare: how runs differing in this component or its options are held to each other
    # (another dispatch/combine backend).
    NUMERICS = {"": "dtype"}


# DeepEP's buffer arithmetic (csrc/elastic/buffer.hpp calculate_buffer_size and its get_dispatch/combine_
# buffer_size, layout.cuh TokenLayout/BufferLayout/WorkspaceLayout at the commit scripts/deepep_source.sh
# pins), for torchtitan's call: bf16 dispatch, allow_hybrid_mode and allow_multiple_reduction on (their
# defaults). Re-derived here from reading the source, not imported: the planner runs without deep_ep.
_ALIGN_BUFFER = 2 * 2**20  # symmetric::kNumAlignmentBytes
_ALIGN_TMA = 32  # ptx::kNumTMAAlignBytes
_HYBRID_CHANNELS = 8 * 160  # ElasticBuffer::kNumMaxChannels (per-SM channels x max SMs)
_WS_RANKS, _WS_EXPERTS, _WS_CHANNELS, _WS_AGRS = 1024, 2048, 1024, 32  # WorkspaceLayout's fixed maxima


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def workspace_bytes() -> int:
    """WorkspaceLayout::get_num_bytes (barrier signals, counters, channel tails), before alignment."""
    r, e, ch = _WS_RANKS, _WS_EXPERTS, _WS_CHANNELS
    return (16 + (r + e) * 8 + r * 8 * 2 + e * 8 * 2 + r * 4 + r * 4 * 2 + e * 4 * 2 + r * ch * 8 + r * ch * 4
            + 2 * 2 * 8 + (_WS_AGRS + 1) * r * 4)


def buffer_bytes(tokens: int, hidden: int, top_k: int, ep: int, gpus_per_node: int = 8) -> int:
    """GPU bytes of the ElasticBuffer torchtitan creates for ``tokens`` per rank (num_max_tokens_per_rank):
    ``get_buffer_size_hint`` (the max of the dispatch and combine layouts, 2 MiB-aligned) plus the
    2 MiB-aligned workspace the constructor adds. EP within a node: direct NVLink mode (no send buffers);
    EP across nodes: hybrid mode (NVLink scale-up x RDMA scale-out)."""
    dispatch_tok = _align(2 * hidden, _ALIGN_TMA) + _align(top_k * 8 + (1 + top_k) * 4, _ALIGN_TMA)
    combine_tok = _align(2 * hidden, _ALIGN_TMA) + _align(top_k * 8, _ALIGN_TMA)
    up = min(ep, gpus_per_node)
    out = ep // up
    if out == 1:
        dispatch = ep * tokens * dispatch_tok
        combine = min(ep, top_k) * tokens * combine_tok
    else:
        dispatch = (up * out * tokens + tokens + out * (tokens + _HYBRID_CHANNELS)) * dispatch_tok
        combine = (min(up, top_k) * out * tokens + out * (tokens + _HYBRID_CHANNELS)
                   + min(out, top_k) * tokens) * combine_tok
    return _align(max(dispatch, combine), _ALIGN_BUFFER) + _align(workspace_bytes(), _ALIGN_BUFFER)
