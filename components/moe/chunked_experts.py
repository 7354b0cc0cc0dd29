"""Chunked expert-parallel MoE: dispatch / combine of one token chunk overlap the expert GEMMs of
its neighbours.

``ChunkedRoutedExperts`` replaces torchtitan's ``RoutedExperts`` (same parameters, same
state-dict keys, same ``forward`` signature, so torchtitan's sharding configs, local_map, FSDP2
and activation checkpointing apply unchanged). The router runs once over all local tokens in
torchtitan's ``MoE.forward`` (so ``tokens_per_expert_E`` and the load-balancing hook see
exactly what they see without chunking); only the routed-expert part is chunked:

1. Plan (no grad): split the T local tokens into n contiguous chunks, sort the T*K routed rows
   by (chunk, expert) (stable, so within a chunk it is torchtitan's expert sort), count rows per
   (chunk, destination rank, local expert) and exchange those counts with ONE all-to-all and
   ONE host sync for all chunks (torchtitan's standard backend also syncs once per layer).
2. Gather the routed rows from x once (autograd through indexing, as torchtitan does).
3. ``_ChunkedExperts`` (a custom autograd.Function) runs the whole EP exchange + grouped-GEMM
   SwiGLU + EP exchange for all chunks with an explicit schedule, forward and backward:

   forward, comm (the process group's own stream on NCCL):  d0 d1 c0 d2 c1 d3 c2 c3
            compute (the current stream):                      G0    G1    G2    G3
     d = dispatch all-to-all, G = permute + 3 grouped GEMMs + unpermute, c = combine all-to-all.
     Every collective is launched with ``async_op=True`` and waited right before its result is
     needed, so d(i+1) and c(i-1) run while G(i) computes. For chunk2 the comm order is
     d0 d1 c0 c1 (seed 000, section 2.4): d1 hides under G0, c0 under G1, c1 is the tail.

   backward, comm:     cb0 cb1 db0 cb2 db1 cb3 db2 db3
             compute:      D0      D1      D2      D3  W(0..3)
     cb = combine-backward all-to-all (output grads to the expert ranks), D = expert dgrad
     (grouped GEMMs for dh, SwiGLU backward, dx), db = dispatch-backward all-to-all (dx back to
     the token ranks), W = the expert weight gradients of every chunk, delayed until after the
     last chunk's dgrad so that they run while db(n-1) (and the tail of db(n-2)) are in flight.

4. Score and scatter-add the combined rows into token order (torchtitan's combine arithmetic:
   fp32 score multiply, deterministic scatter-add).

Device notes: nothing here branches on the device. On CUDA/NCCL an ``async_op=True``
collective runs on ProcessGroupNCCL's internal stream, which waits for the current stream at
launch; ``work.wait()`` makes the current stream wait for it - that is the communication stream
of the schedule above, and the current stream is the compute stream. On CPU/gloo the same calls
run on gloo's worker threads and ``wait()`` blocks; the arithmetic is identical, there is just
nothing worth overlapping.

Numerics versus torchtitan's unchunked path (``moe.chunk=none``):
- forward output, input gradient, router/score gradients: the same operations on the same
  rows (GEMM rows are independent; each token's top-k contributions are summed in the same
  expert order), so they are bitwise equal where the grouped GEMM's per-row result does not
  depend on how many rows share the call (true for torch's CPU kernels; on CUDA, cuBLAS/CUTLASS
  may pick different tiles for smaller M, so compare with a tolerance there).
- Communication: dispatch and combine move bf16 (the GEMM dtype) instead of the activation dtype
  (rounding commutes with data movement, so this is exact and halves the bytes for fp32
  activations); dispatch-backward moves the activation dtype, as torchtitan does.
- expert weight gradients: summed per chunk (n bf16 grouped-GEMM partials accumulated in the
  parameter dtype) instead of one grouped GEMM over all rows: equal within bf16 rounding, not
  bitwise.
- Saved for backward per chunk: the expert-major input and the two gate/up pre-activations
  (bf16); silu(a1) and h = silu(a1) * a3 are recomputed in backward (torchtitan keeps those two
  as well, so this path saves 2 x rows x hidden bf16 per layer less).

Not supported (refused when the config is swapped): token dispatchers other than torchtitan's
standard all-to-all (DeepEP, HybridEP, MinimalAsyncEP, TorchAO padding), expert modules other
than ``GroupedExperts`` (e.g. gpt-oss biases, MXFP8 grouped GEMM converters), spmd_types type
checking. With EP=1 (no mesh) the chunked arithmetic runs without collectives (useful only to
validate; ``auto`` picks 1 chunk there, which is torchtitan's path).

"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
from torchtitan.ops.scatter_add import deterministic_scatter_add

from components.moe.auto_chunks import auto_num_chunks

# torchtitan's GroupedExperts runs its grouped GEMMs in bf16 whatever the activation dtype.
from components.moe.chunk_plan import ChunkPlan, _exchange, _Pending, build_plan
from components.moe.lean_combine import score_rows, score_rows_reference

# torchtitan's GroupedExperts runs its grouped GEMMs in bf16 whatever the activation dtype.
GEMM_DTYPE = torch.bfloat16
SUPPORTED_DISPATCHERS = (AllToAllTokenDispatcher.Config, LocalTokenDispatcher.Config)


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def _to_expert_major(rows: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return rows if perm is None else rows[perm]


def _to_rank_major(rows: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    if perm is None:
        return rows
    out = torch.empty_like(rows)
    out[perm] = rows  # index_put (deterministic-mode safe), as torchtitan's _unpermute
    return out


def _accumulate(acc: torch.Tensor | None, part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if acc is None:
        return part.to(dtype)
    return acc.add_(part)


class _ChunkedExperts(torch.autograd.Function):
    """EP dispatch -> SwiGLU grouped GEMMs -> EP combine for every chunk, with an explicit
    overlapped schedule in forward and backward (see the module docstring).

    x_N: routed rows in the sender-side (chunk, expert)-sorted layout, activation dtype.
    w1, w3: [local experts, hidden, dim]; w2: [local experts, dim, hidden] (plain local tensors).
    Returns the combined expert outputs in the same row layout as x_N.
    """

    @staticmethod
    def forward(ctx, x_N, w1, w2, w3, plan: ChunkPlan):
        n, group = plan.num_chunks, plan.group
        act_dtype = x_N.dtype
        xb = x_N.to(GEMM_DTYPE)
        w1b, w2b, w3b = w1.to(GEMM_DTYPE), w2.to(GEMM_DTYPE), w3.to(GEMM_DTYPE)
        w1t, w2t, w3t = w1b.transpose(-2, -1), w2b.transpose(-2, -1), w3b.transpose(-2, -1)
        out = torch.empty_like(xb)
        dispatched: dict[int, _Pending] = {}

        def dispatch(c: int) -> None:
            lo, hi = plan.send_bounds[c]
            dispatched[c] = _exchange(group, xb[lo:hi], plan.recv_splits[c], plan.send_splits[c])

        for c in range(min(2, n)):
            dispatch(c)
        combines, saved = [], []
        for c in range(n):
            perm, offs = plan.perms[c], plan.offsets[c]
            xe = _to_expert_major(dispatched.pop(c).wait(), perm)
            a1 = _gmm(xe, w1t, offs)
            a3 = _gmm(xe, w3t, offs)
            ye = _gmm(F.silu(a1) * a3, w2t, offs)
            lo, hi = plan.send_bounds[c]
            combines.append(_exchange(group, _to_rank_major(ye, perm), plan.send_splits[c],
                                      plan.recv_splits[c], out=out[lo:hi]))
            if c + 2 < n:
                dispatch(c + 2)
            saved += [xe, a1, a3]
        for p in combines:
            p.wait()

        perms = [p for p in plan.perms if p is not None]
        ctx.save_for_backward(w1b, w2b, w3b, *saved, *plan.offsets, *perms)
        ctx.n, ctx.group, ctx.has_perm = n, group, bool(perms)
        ctx.send_splits, ctx.recv_splits, ctx.send_bounds = plan.send_splits, plan.recv_splits, plan.send_bounds
        ctx.act_dtype, ctx.w_dtypes = act_dtype, (w1.dtype, w2.dtype, w3.dtype)
        return out.to(act_dtype)

    @staticmethod
    def backward(ctx, g_N):
        n, group = ctx.n, ctx.group
        tensors = ctx.saved_tensors
        w1b, w2b, w3b = tensors[:3]
        saved = tensors[3:3 + 3 * n]
        offsets = tensors[3 + 3 * n:3 + 4 * n]
        perms = tensors[3 + 4 * n:] if ctx.has_perm else [None] * n
        gb = g_N.to(GEMM_DTYPE).contiguous()
        dx_N = torch.empty(g_N.shape, dtype=ctx.act_dtype, device=g_N.device)
        arrived: dict[int, _Pending] = {}

        def combine_backward(c: int) -> None:
            lo, hi = ctx.send_bounds[c]
            arrived[c] = _exchange(group, gb[lo:hi], ctx.recv_splits[c], ctx.send_splits[c])

        for c in range(min(2, n)):
            combine_backward(c)
        returns, wgrad_inputs = [], []
        for c in range(n):
            perm, offs = perms[c], offsets[c]
            xe, a1, a3 = saved[3 * c:3 * c + 3]
            gy = _to_expert_major(arrived.pop(c).wait(), perm)
            # dgrad (the ops autograd would run for torchtitan's GroupedExperts.forward)
            s = F.silu(a1)
            dh = _gmm(gy, w2b, offs)
            da3 = dh * s
            da1 = torch.ops.aten.silu_backward(dh * a3, a1)
            dx = _gmm(da1, w1b, offs).to(ctx.act_dtype) + _gmm(da3, w3b, offs).to(ctx.act_dtype)
            lo, hi = ctx.send_bounds[c]
            returns.append(_exchange(group, _to_rank_major(dx, perm), ctx.send_splits[c],
                                     ctx.recv_splits[c], out=dx_N[lo:hi]))
            if c + 2 < n:
                combine_backward(c + 2)
            wgrad_inputs.append((c, gy, da1, da3))
            del s, dh, dx
        # Delayed wgrad: after the last chunk's dgrad, while the tail dispatch-backward is in flight.
        g1 = g2 = g3 = None
        d1, d2, d3 = ctx.w_dtypes
        while wgrad_inputs:
            c, gy, da1, da3 = wgrad_inputs.pop(0)
            xe, a1, a3 = saved[3 * c:3 * c + 3]
            offs = offsets[c]
            h = F.silu(a1) * a3  # recomputed here rather than kept alive across the dgrad loop
            g2 = _accumulate(g2, _gmm(gy.t(), h, offs), d2)
            g1 = _accumulate(g1, _gmm(da1.t(), xe, offs), d1)
            g3 = _accumulate(g3, _gmm(da3.t(), xe, offs), d3)
            del gy, da1, da3, h
        for p in returns:
            p.wait()
        return dx_N, g1, g2, g3, None


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class ChunkedRoutedExperts(RoutedExperts):
    """torchtitan's RoutedExperts with the chunked, overlapped EP schedule (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        num_chunks: int | None = 2  # None: pick per forward with components.moe.auto_chunks.auto_num_chunks

    LEAN_SCORING = False  # moe.lean_combine sets it on the instances (components.moe.lean_combine.install)

    def __init__(self, config: Config):
        super().__init__(config)
        if type(self.inner_experts) is not GroupedExperts:
            raise NotImplementedError(f"chunked EP supports torchtitan's GroupedExperts, not "
                                      f"{type(self.inner_experts).__name__}")
        if type(config.token_dispatcher) not in SUPPORTED_DISPATCHERS:
            raise NotImplementedError(f"chunked EP supports torchtitan's standard all-to-all dispatcher, not "
                                      f"{type(config.token_dispatcher).__qualname__}")
        self.num_chunks = config.num_chunks
        self.last_num_chunks = 0  # chunks used by the latest forward (1: torchtitan's path)
        self.schedule_runs = 0  # forwards (incl. recompute) that ran the chunked schedule

    def chunks_for(self, num_tokens: int, ep_size: int) -> int:
        if self.num_chunks is None:
            n = auto_num_chunks(num_tokens, ep_size=ep_size, num_experts=self.inner_experts.num_experts,
                                top_k=self.token_dispatcher.top_k)
        else:
            n = self.num_chunks
        return max(1, min(n, num_tokens))

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        T = B * L
        mesh = getattr(self.token_dispatcher, "ep_mesh", None)
        ep_size = mesh.size() if mesh is not None else 1
        n = self.chunks_for(T, ep_size)
        self.last_num_chunks = n
        if n <= 1:
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        _refuse_spmd_typechecking()

        x_TD = x_BLD.reshape(T, D)
        with torch.no_grad():
            plan = build_plan(topk_expert_ids_BLK.reshape(T, K), n, self.inner_experts.num_experts,
                              mesh.get_group() if mesh is not None else None, ep_size)
        token_N = torch.div(plan.order_N, K, rounding_mode="floor")
        routed_in_N = x_TD[token_N]
        scores_N = topk_scores_BLK.reshape(T * K)[plan.order_N]
        ex = self.inner_experts
        routed_out_N = _ChunkedExperts.apply(routed_in_N, _local(ex.w1_EFD), _local(ex.w2_EDF),
                                             _local(ex.w3_EFD), plan)
        # moe.lean_combine (components/moe/lean_combine.py): the same values with bf16 saves
        routed_out_N = (score_rows if self.LEAN_SCORING else score_rows_reference)(routed_out_N, scores_N)
        out_TD = deterministic_scatter_add(torch.zeros_like(x_TD), token_N.reshape(-1, 1).expand(-1, D),
                                           routed_out_N)
        self.schedule_runs += 1
        return out_TD.view(B, -1, D)


def _refuse_spmd_typechecking() -> None:
    try:
        import spmd_types as spmd  # optional dependency: spmd_types
    except ImportError:
        return
    if spmd.is_type_checking():
        raise NotImplementedError("chunked EP does not support spmd_types type checking "
                                  "(debug.spmd_typechecking); use moe.chunk=none for that run")


def use_chunked_experts(model_config, num_chunks: int | None) -> int:
    """Swap every RoutedExperts config in a torchtitan model config for ChunkedRoutedExperts.

    num_chunks: 2, 3, 4 ... or None for the auto rule. Returns how many MoE layers were swapped
    (0 for a dense model). Raises ValueError for dispatchers / expert modules it cannot chunk.
    """
    swapped = 0
    for fqn, cfg, parent, attr in list(model_config.traverse(RoutedExperts.Config)):
        if isinstance(cfg, ChunkedRoutedExperts.Config):
            cfg.num_chunks = num_chunks
            swapped += 1
            continue
        if type(cfg) is not RoutedExperts.Config:
            raise ValueError(f"{fqn}: cannot chunk {type(cfg).__qualname__}")
        if type(cfg.inner_experts) is not GroupedExperts.Config:
            raise ValueError(f"{fqn}: chunked EP needs GroupedExperts, got {type(cfg.inner_experts).__qualname__}")
        if type(cfg.token_dispatcher) not in SUPPORTED_DISPATCHERS:
            raise ValueError(f"{fqn}: chunked EP runs on torchtitan's standard all-to-all dispatcher; "
                             f"got {type(cfg.token_dispatcher).__qualname__}")
        new = ChunkedRoutedExperts.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
                                          num_chunks=num_chunks)
        if parent is None:
            raise ValueError("the model config itself is a RoutedExperts config; pass the model config")
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
        swapped += 1
    return swapped
