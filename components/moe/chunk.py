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

from components.moe import replay
from components.moe.auto_chunks import AUTO_MIN_EP
from components.moe.comm import MoeOptions
from framework.contracts import PlanConstant, PlanFacts, PlanTerms
from framework.errors import UserError

# the planner's constant of the chunk policies; calibrate as `apiary plan calib.ep_overlap.chunk2=0.3`
PLAN_CONSTANTS = {
    "ep_overlap": PlanConstant({"none": 0.0, "chunk2": 0.25, "chunk3": 0.3, "chunk4": 0.3, "auto": 0.3},
                               "fraction of EP all-to-all hidden under expert compute, by moe.chunk (0.25 for chunk2 "
                               "gives seed 000's single-MoE-layer proxy gain at 32K, +18%, in this model)."),
}


def _overlap(ctx, policy: str) -> float:
    """The calibrated fraction of the EP all-to-all that ``policy`` hides (PlanFacts.ep_overlap)."""
    return float(ctx.plan.constants.ep_overlap.get(policy, 0.0))


def _check_comm(where: str, comm_backend: str) -> None:
    """Chunking runs on torchtitan's standard all-to-all dispatcher only."""
    if comm_backend != "standard":
        raise UserError(where, f"chunked EP overlap needs the standard all-to-all dispatcher (moe.comm=alltoall), "
                               f"not torchtitan backend {comm_backend!r}.", "Use moe.chunk=none with this moe.comm.")


def _backend(ctx) -> str:
    return ctx.components["moe_comm"].torchtitan_backend


def _check_lean(options, ctx) -> None:
    """``moe.lean_combine=true`` where the lean scoring cannot run is refused (null: where it runs)."""
    if options.lean_combine is True and _backend(ctx) != "standard":
        raise UserError("moe.lean_combine=true", f"the lean combine scores torchtitan's standard all-to-all "
                        f"combine; moe.comm={options.comm} combines with its own kernels.",
                        "Leave moe.lean_combine unset (null) or false with this moe.comm.")


def _fp32_combine(options, ctx) -> bool:
    """Whether the MoE combine keeps torchtitan's fp32 copies (the planner's ``fp32_combine`` fact):
    moe.lean_combine=false or another dispatcher. The planner passes no options for this kind (its
    section is ``moe:``): the recipe's ``moe:`` then."""
    moe = options if options is not None and hasattr(options, "lean_combine") else ctx.cfg.moe
    chosen = getattr(ctx, "components", None) or {}
    backend = chosen["moe_comm"].torchtitan_backend if "moe_comm" in chosen else "standard"
    return moe.lean_combine is False or backend != "standard"


def _use_lean(options, tc) -> None:
    """``moe.lean_combine`` null or true: the built model scores with components.moe.lean_combine."""
    if options.lean_combine is False:
        return
    from components.moe import lean_combine  # reason: torchtitan, at build only

    lean_combine.use(tc)


def _check_moe(options, ctx) -> None:
    """The ``moe:`` settings every chunk policy checks: ``moe.lean_combine``, ``moe.routing_replay``."""
    _check_lean(options, ctx)
    replay.check(options, ctx)


def _apply_moe(options, tc) -> None:
    """The ``moe:`` settings every chunk policy applies to the built model: the lean combine, then
    routing replay (its router hooks go on before the lean combine's patch and torchtitan's parallelize)."""
    _use_lean(options, tc)
    replay.apply(options, tc)


class NoChunk:
    """One dispatch -> grouped GEMM -> combine per MoE layer (the baseline)."""

    PLAN_CONSTANTS = PLAN_CONSTANTS
    Options = MoeOptions

    @staticmethod
    def convert(model_config) -> None:
        return None

    @staticmethod
    def check(options, ctx) -> None:
        _check_moe(options, ctx)

    @staticmethod
    def apply(options, tc, ctx) -> None:
        _apply_moe(options, tc)

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """One chunk; the all-to-all hides ``ep_overlap.none`` under compute."""
        return PlanTerms(facts=PlanFacts(chunks=1, ep_overlap=_overlap(ctx, "none"),
                                         fp32_combine=_fp32_combine(opts, ctx)))

    # apiary compare: how runs differing in this component or its options are held to each other
    # (the unchunked path: against another chunking, that component's kind, the looser, applies).
    NUMERICS = {"": "exact"}


class Chunked:
    """Split each MoE layer's local tokens into ``num_chunks`` chunks with an overlapped
    dispatch / grouped-GEMM / combine schedule (forward and backward)."""

    PLAN_CONSTANTS = PLAN_CONSTANTS
    Options = MoeOptions

    def __init__(self, num_chunks: int):
        if num_chunks < 2:
            raise ValueError(f"Chunked needs at least 2 chunks, got {num_chunks} (use NoChunk)")
        self.num_chunks = num_chunks

    def convert(self, model_config) -> None:
        """Edit the model config's routed experts (before it is built)."""
        from components.moe.chunked_experts import use_chunked_experts  # reason: torchtitan, at build only

        use_chunked_experts(model_config, self.num_chunks)

    def check(self, options, ctx) -> None:
        """Before any worker starts: refuse dispatchers this policy cannot chunk (UserError)."""
        _check_comm(f"moe.chunk={options.chunk}", _backend(ctx))
        _check_moe(options, ctx)

    def apply(self, options, tc, ctx) -> None:
        self.convert(tc.model_spec.model)
        _apply_moe(options, tc)

    def __repr__(self) -> str:
        return f"Chunked({self.num_chunks})"

    def plan_terms(self, opts, ctx) -> PlanTerms:
        """Dispatch/combine buffers per chunk; the all-to-all hides ``ep_overlap.chunkN``."""
        return PlanTerms(facts=PlanFacts(chunks=self.num_chunks, ep_overlap=_overlap(ctx, f"chunk{self.num_chunks}"),
                                         fp32_combine=_fp32_combine(opts, ctx)))

    # apiary compare: how runs differing in this component or its options are held to each other.
    # Chunking reschedules dispatch/combine around the same expert GEMMs, but each expert weight
    # gradient becomes a sum of per-chunk bf16 grouped-GEMM partials (torchtitan's experts run in bf16
    # whatever training.dtype is): 2.1e-3 norm-wise on CPU (debug_moe, none vs chunk2), every other
    # step-0 gradient, the logits and the step-0 loss bitwise; the curves then differ by ~1e-6.
    NUMERICS = {"": "bf16"}


class AutoChunk:
    """Chunk count chosen per forward by ``components.moe.auto_chunks.auto_num_chunks`` (local
    tokens, EP size, GEMM rows)."""

    PLAN_CONSTANTS = PLAN_CONSTANTS
    Options = MoeOptions

    @staticmethod
    def convert(model_config) -> None:
        from components.moe.chunked_experts import use_chunked_experts  # reason: torchtitan, at build only

        use_chunked_experts(model_config, None)

    @staticmethod
    def check(options, ctx) -> None:
        _check_comm(f"moe.chunk={options.chunk}", _backend(ctx))
        _check_moe(options, ctx)

    @staticmethod
    def apply(options, tc, ctx) -> None:
        AutoChunk.convert(tc.model_spec.model)
        _apply_moe(options, tc)

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """Planned as 2 chunks of buffers; below ``AUTO_MIN_EP`` auto runs unchunked, so its
        all-to-all is planned as the unchunked one's (``ep_overlap.none``), else ``ep_overlap.auto``."""
        return PlanTerms(facts=PlanFacts(chunks=2, ep_overlap=_overlap(ctx, "none" if ctx.layout.ep < AUTO_MIN_EP else "auto"),
                                         fp32_combine=_fp32_combine(opts, ctx)))

    # apiary compare: how runs differing in this component or its options are held to each other
    # (as Chunked's: where auto picks more than one chunk, expert weight gradients are bf16 partial sums).
    NUMERICS = {"": "bf16"}


# registry.yaml targets: components.moe.chunk:chunk2 / chunk3 / chunk4 / AutoChunk
chunk2 = Chunked(2)
chunk3 = Chunked(3)
chunk4 = Chunked(4)
