"""Expert-parallel chunk policies: how a MoE layer's local tokens are split to overlap
dispatch/combine with expert compute.

The moe_chunk protocol: ``apply(model_config)`` edits a torchtitan model config before it is
built. ``Chunked(n)`` and ``AutoChunk`` swap every ``RoutedExperts`` config for
``components.moe.chunked_experts.ChunkedRoutedExperts`` (same parameters and state-dict keys);
the router, its load-balancing statistics and the shared experts are untouched. The schedule
itself is documented in components/moe/chunked_experts.py and docs/skills/moe_chunk.md.

This module stays import-light (no torchtitan at import time): the framework resolves it
before the worker has installed the device shims.
"""

from __future__ import annotations

from components.moe.comm import MoeOptions
from framework.errors import UserError

# The auto rule. Rows: (local tokens per rank below which this row applies, chunks).
# The token thresholds follow seed 000's single-layer trend (chunk2 gains +7.8% at 4K tokens
# and grows with length, to +24% at 64K: longer sequences give longer communication windows);
# 3 and 4 chunks only where every chunk still has long expert GEMMs. Not yet refit from
# benchmarks/moe_layer_bench.py on H200: update this table from its JSON when measured.
AUTO_TOKEN_TABLE: tuple[tuple[float, int], ...] = (
    (4_096, 1),  # < 4K tokens/rank: windows too short to pay for more kernels and syncs
    (32_768, 2),  # 4K .. 32K: chunk2 (the seed's measured setting)
    (65_536, 3),  # 32K .. 64K: chunk3
    (float("inf"), 4),  # >= 64K: chunk4
)
# Kernel-shape floor: expected grouped-GEMM rows per local expert per chunk under balanced
# routing (tokens * top_k * ep / experts / chunks). Below ~256 rows the bf16 grouped GEMM on
# H100/H200-class GPUs runs mostly partial 128-row tiles and its efficiency drops fast, which
# eats the overlap gain; the auto rule lowers the chunk count until every chunk clears it.
AUTO_MIN_ROWS_PER_EXPERT = 256
# Smallest EP size the auto rule chunks. Measured with benchmarks/moe_layer_bench.py on H200s
# of one host (NVLink; dim 2048, 256 experts top-8; docs/benchmarks.md): at EP 2, chunk2/3/4 were
# 0.7-28% slower than none at 4K-64K tokens per rank; at EP 4, the best chunked policy was within
# -2.7%..+3.0% of none (noise-sized) and chunk3/4 lost 12-22% at 4K. Inside one node the
# all-to-all leaves nothing worth hiding, so auto chunks from EP 8 on (the seed's cross-node
# setting, unmeasured here).
AUTO_MIN_EP = 8


def auto_num_chunks(num_tokens: int, *, ep_size: int, num_experts: int, top_k: int,
                    table=None, min_rows_per_expert: int | None = None) -> int:
    """Chunk count for one MoE layer from local tokens, EP size and the grouped-GEMM shape.

    1 (torchtitan's unchunked path) when there is no EP communication to hide (ep_size 1).
    ``table`` / ``min_rows_per_expert`` default to the module constants, read at call time.
    """
    table = AUTO_TOKEN_TABLE if table is None else table
    min_rows_per_expert = AUTO_MIN_ROWS_PER_EXPERT if min_rows_per_expert is None else min_rows_per_expert
    if ep_size < AUTO_MIN_EP or num_tokens <= 0:
        return 1
    n = next(chunks for limit, chunks in table if num_tokens < limit)
    rows_per_expert = num_tokens * top_k * ep_size / num_experts
    while n > 1 and rows_per_expert / n < min_rows_per_expert:
        n -= 1
    return n


def _check_comm(where: str, comm_backend: str) -> None:
    """Chunking runs on torchtitan's standard all-to-all dispatcher only."""
    if comm_backend != "standard":
        raise UserError(where, f"chunked EP overlap needs the standard all-to-all dispatcher (moe.comm=alltoall), "
                               f"not torchtitan backend {comm_backend!r}.", "Use moe.chunk=none with this moe.comm.")


def _backend(ctx) -> str:
    return ctx.components["moe_comm"].torchtitan_backend


class NoChunk:
    """One dispatch -> grouped GEMM -> combine per MoE layer (the baseline)."""

    Options = MoeOptions

    @staticmethod
    def convert(model_config) -> None:
        return None

    @staticmethod
    def check(options, ctx) -> None:
        return None

    @staticmethod
    def apply(options, tc, ctx) -> None:
        return None


class Chunked:
    """Split each MoE layer's local tokens into ``num_chunks`` chunks with an overlapped
    dispatch / grouped-GEMM / combine schedule (forward and backward)."""

    Options = MoeOptions

    def __init__(self, num_chunks: int):
        if num_chunks < 2:
            raise ValueError(f"Chunked needs at least 2 chunks, got {num_chunks} (use NoChunk)")
        self.num_chunks = num_chunks

    def convert(self, model_config) -> None:
        """Edit the model config's routed experts (before it is built)."""
        from components.moe.chunked_experts import use_chunked_experts  # reason: imports torchtitan (after devices.install)

        use_chunked_experts(model_config, self.num_chunks)

    def check(self, options, ctx) -> None:
        """Before any worker starts: refuse dispatchers this policy cannot chunk (UserError)."""
        _check_comm(f"moe.chunk={options.chunk}", _backend(ctx))

    def apply(self, options, tc, ctx) -> None:
        self.convert(tc.model_spec.model)

    def __repr__(self) -> str:
        return f"Chunked({self.num_chunks})"


class AutoChunk:
    """Chunk count chosen per forward by ``auto_num_chunks`` (local tokens, EP size, GEMM rows)."""

    Options = MoeOptions

    @staticmethod
    def convert(model_config) -> None:
        from components.moe.chunked_experts import use_chunked_experts  # reason: imports torchtitan (after devices.install)

        use_chunked_experts(model_config, None)

    @staticmethod
    def check(options, ctx) -> None:
        _check_comm(f"moe.chunk={options.chunk}", _backend(ctx))

    @staticmethod
    def apply(options, tc, ctx) -> None:
        AutoChunk.convert(tc.model_spec.model)


# registry.yaml targets: components.moe.chunk:chunk2 / chunk3 / chunk4 / AutoChunk
chunk2 = Chunked(2)
chunk3 = Chunked(3)
chunk4 = Chunked(4)
