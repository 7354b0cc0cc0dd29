"""Gated DeltaNet for apiary's text-only Qwen3.5: a torch path (any device, the CPU path) and
fla's Triton kernels (CUDA), with context parallelism for both.

The recurrence (per head, state S of shape [K, V], fla's convention)::

    S_t = exp(g_t) * S_{t-1}
    u_t = beta_t * (v_t - S_t^T k_t)
    S_t = S_t + k_t u_t^T
    o_t = scale * S_t^T q_t          (q, k L2-normalised, scale = K ** -0.5)

Torch path (``chunk_gated_delta_rule``): chunks of C tokens, each solved in closed form with a
unit-lower-triangular system (the WY form), so within a chunk everything is a batched matmul;
only the [K, V] state walks from chunk to chunk. Every chunk is an affine map of the state it
starts from: ``S_end = M S_start + b``. Packed documents reset the state: positions where a
new document starts cut the decay products (``resets``), so no token sees another document.

Context parallelism (``GDNContext``): the sequence is cut into *parts* that follow one chain
in true token order. Without load balancing each rank holds one part (rank order); with
torchtitan's head-tail balancing (the layout fla calls "zigzag") rank r holds parts r and
2*cp-1-r, stored [front; back]. Each rank computes (M, b) of its parts, all-gathers them
(a few [K, K] + [K, V] matrices per head: traffic independent of sequence length), composes
the chain to get every part's true initial state, and reruns its parts from there. The
causal conv gets the last kernel_size-1 inputs of the chain-previous part the same way.
Gradients flow back through the all-gather (its backward sums the gradients of all ranks).
On CUDA the same layouts go through fla's own CP kernels (``fla.ops.cp``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.models.qwen3_5.model import GatedDeltaKernel, GatedDeltaNet

from components.models.gated_deltanet_ops import CHUNK, _expand_heads, _Prepared, causal_conv, chunk_gated_delta_rule, l2norm

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- CP plumbing

class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim; backward sums the gradients of every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous().unsqueeze(0)
        out = x.new_empty(world, *x.shape[1:])
        dist.all_gather_single(out, x, group=group)  # [world * 1, ...]: gloo and NCCL (all_gather_into_tensor: deprecated)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


def _tie(x: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """Make ``x`` depend on ``gathered`` (zero contribution), so every rank runs the gather's
    backward collective, also a rank whose outputs do not read the gathered values (the chain's
    first part reads no predecessor); otherwise the ranks' collectives would not pair up."""
    if not gathered.requires_grad:
        return x
    return x + (gathered.sum() * 0).to(x.dtype)


@dataclass
class CPInfo:
    """Where this rank's tokens sit in the sequence."""

    group: object
    world: int
    rank: int
    layout: str  # "contiguous" (no load balancing) or "zigzag" (torchtitan's head-tail)

    @property
    def n_parts(self) -> int:
        return 1 if self.layout == "contiguous" else 2

    def chain(self, rank: int) -> list[int]:
        """Chain positions of a rank's local parts, in local order."""
        if self.layout == "contiguous":
            return [rank]
        return [rank, 2 * self.world - 1 - rank]

    def owner(self) -> dict[int, tuple[int, int]]:
        """chain position -> (rank, local part index)."""
        return {c: (r, i) for r in range(self.world) for i, c in enumerate(self.chain(r))}


class GDNContext:
    """What every GatedDeltaNet layer of one forward needs: document starts, CP placement.

    A plain object (not a dataclass), so FSDP's input casting leaves it alone.
    """

    def __init__(self, *, resets: torch.Tensor | None, cp: CPInfo | None = None, varlen=None,
                 fla_cp: list | None = None):
        self.resets = resets  # [B, L_local] bool: a document starts here (positions == 0)
        self.cp = cp
        self.varlen = varlen  # torchtitan VarlenMetadata for fla's non-CP path
        self.fla_cp = fla_cp  # per batch row FLACPContext (fla's CP path)
        self._halo_resets = None

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        n = self.cp.n_parts if self.cp else 1
        return list(x.chunk(n, dim=1))

    def halo_resets(self, W: int) -> list[torch.Tensor]:
        """Reset flags of the W-1 tokens before each local part (gathered once per forward)."""
        if self._halo_resets is None:
            self._halo_resets = [h.bool() for h in self._halos(
                [r.to(torch.uint8) for r in self.parts(self.resets)], W, fill_first=1)]
        return self._halo_resets

    def _halos(self, parts: list[torch.Tensor], W: int, fill_first=0) -> list[torch.Tensor]:
        """The last W-1 tokens of each part's chain predecessor ([B, W-1, ...] per local part)."""
        cp = self.cp
        tails = torch.stack([p[:, -(W - 1):] for p in parts])  # [n_parts, B, W-1, ...]
        gathered = all_gather(tails, cp.group)  # [world, n_parts, B, W-1, ...]
        owner = cp.owner()
        out = []
        for c in cp.chain(cp.rank):
            if c == 0:
                h = torch.full_like(tails[0], fill_first) if fill_first else torch.zeros_like(tails[0])
            else:
                r, i = owner[c - 1]
                h = gathered[r, i]
            out.append(_tie(h, gathered) if h.is_floating_point() else h)
        return out

    def conv_halos(self, x: torch.Tensor, W: int) -> list[torch.Tensor]:
        return self._halos(self.parts(x), W)


def cp_gated_delta_rule(q, k, v, g, beta, ctx: GDNContext, scale=None, chunk=CHUNK):
    """Torch gated delta rule over the CP chain (see the module docstring)."""
    cp = ctx.cp
    q, k = _expand_heads(q, k, v)
    q, k = l2norm(q.float()), l2norm(k.float())
    scale = scale if scale is not None else k.shape[-1] ** -0.5
    pieces = [ctx.parts(t) for t in (q, k, v, g, beta)]
    resets = ctx.parts(ctx.resets) if ctx.resets is not None else [None] * cp.n_parts
    prepared = [_Prepared(*(p[i] for p in pieces), resets[i], scale, chunk) for i in range(cp.n_parts)]
    maps = [pr.transition() for pr in prepared]
    K = maps[0][0].shape[-1]
    mb_local = torch.stack([torch.cat([m, b], dim=-1) for m, b in maps])  # [n_parts, B, H, K, K + V]
    mb_all = all_gather(mb_local, cp.group)
    m_all, b_all = mb_all[..., :K], mb_all[..., K:]
    owner = cp.owner()
    starts, s = {}, _tie(torch.zeros_like(maps[0][1]), mb_all)
    for c in range(cp.world * cp.n_parts):
        starts[c] = s
        r, i = owner[c]
        s = m_all[r, i] @ s + b_all[r, i]
    outs = [prepared[i].run(starts[c])[0] for i, c in enumerate(cp.chain(cp.rank))]
    return torch.cat(outs, dim=1)


# --------------------------------------------------------------------------- modules

class GatedDeltaRule(GatedDeltaKernel):
    """The recurrence kernel: ``backend`` "torch" (any device) or "fla" (fla's Triton kernels).

    Same call signature as torchtitan's GatedDeltaKernel (varlen through ``cu_seqlens`` on a
    folded [1, B*L] batch); framework.devices.linear_attention_backend() picks the backend.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GatedDeltaKernel.Config):
        backend: str = "torch"  # "torch" | "fla"

    def __init__(self, config: Config):
        super().__init__(GatedDeltaKernel.Config(backend="fla_chunked"))
        self.impl = config.backend

    def forward(self, xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, *, cu_seqlens=None, cu_seqlens_cpu=None):
        if self.impl == "fla":
            return super().forward(xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, cu_seqlens=cu_seqlens,
                                   cu_seqlens_cpu=cu_seqlens_cpu)
        resets = None
        if cu_seqlens is not None:
            resets = _resets_from_cu_seqlens(cu_seqlens, xq_BLNK.shape[1]).unsqueeze(0)
        return chunk_gated_delta_rule(xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, resets=resets)[0]


def _resets_from_cu_seqlens(cu: torch.Tensor, T: int) -> torch.Tensor:
    r = torch.zeros(T, dtype=torch.bool, device=cu.device)
    starts = cu[:-1].long()
    r[starts[starts < T]] = True
    return r


_FP32_WARNED = False


def warn_fla_fp32(dtype: torch.dtype, training: bool) -> bool:
    """Warn once per process when fla's kernels would train on fp32 activations: their gate
    gradient (A_log, dt_bias, in_proj_a) was measured 10%-12% off the torch path on H200 in the
    layer test (up to 40x on a model's small gate gradients) while bf16 agrees
    (tests/gpu/test_qwen35_gpu.py). Returns whether it warned now."""
    global _FP32_WARNED
    if _FP32_WARNED or dtype != torch.float32 or not training:
        return False
    _FP32_WARNED = True
    logger.warning("GatedDeltaNet runs fla's kernels on fp32 activations with gradients: fla's fp32 gate "
                   "gradients (A_log, dt_bias, in_proj_a) were measured 10-12 percent off the exact ones on "
                   "H200 (up to 40x on small ones), bf16 agrees. Train with training.dtype=bfloat16 (the "
                   "default); the exact fp32 path is the torch one "
                   "(framework.api.build_model(..., linear_backend='torch')).")
    return True


class ApiaryGatedDeltaNet(GatedDeltaNet):
    """torchtitan's GatedDeltaNet (same parameters and names) with a torch path and CP.

    ``forward(x, ctx)``: ``ctx`` is the model's per-forward GDNContext (None: one sequence per
    row, no document starts). fla without CP runs torchtitan's own forward unchanged.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GatedDeltaNet.Config):
        pass

    def forward(self, x_BLD: torch.Tensor, ctx: GDNContext | None = None) -> torch.Tensor:
        fla = getattr(self.kernel, "impl", "fla") == "fla"
        cp = ctx is not None and ctx.cp is not None
        if fla:
            warn_fla_fp32(x_BLD.dtype, torch.is_grad_enabled())
        if fla and not cp:
            return super().forward(x_BLD, ctx.varlen if ctx is not None else None)
        B, L, _ = x_BLD.shape
        W = self.conv_kernel_size
        qkv = [self.in_proj_q(x_BLD), self.in_proj_k(x_BLD), self.in_proj_v(x_BLD)]
        sizes = [t.shape[-1] for t in qkv]
        mixed = torch.cat(qkv, dim=-1)
        weight = torch.cat([self.conv_q.weight, self.conv_k.weight, self.conv_v.weight], dim=0)
        z = self.in_proj_z(x_BLD).reshape(B, L, -1, self.value_head_dim)
        g = -torch.exp(self.A_log.float()) * F.softplus(self.in_proj_a(x_BLD).float() + self.dt_bias)
        beta = torch.sigmoid(self.in_proj_b(x_BLD))
        if fla:
            o = self._fla_cp(mixed, weight, sizes, g, beta, ctx)
        else:
            resets = ctx.resets if ctx is not None else None
            if cp:
                halos = ctx.conv_halos(mixed, W)
                hres = ctx.halo_resets(W)
                parts, rparts = ctx.parts(mixed), ctx.parts(resets)
                mixed = torch.cat([causal_conv(p, weight, r, h, hr)
                                   for p, r, h, hr in zip(parts, rparts, halos, hres)], dim=1)
            else:
                mixed = causal_conv(mixed, weight, resets)
            q, k, v = mixed.split(sizes, dim=-1)
            q = q.reshape(B, L, -1, self.key_head_dim)
            k = k.reshape(B, L, -1, self.key_head_dim)
            v = v.reshape(B, L, -1, self.value_head_dim)
            if cp:
                o = cp_gated_delta_rule(q, k, v, g, beta, ctx)
            else:
                o = chunk_gated_delta_rule(q, k, v, g, beta, resets=resets)[0]
        o = self.norm(o, z)
        return self.out_proj(o.reshape(B, L, -1))

    def _fla_cp(self, mixed, weight, sizes, g, beta, ctx: GDNContext):
        """fla's context-parallel conv and gated delta rule, one batch row at a time."""
        from fla.modules.causal_conv1d import causal_conv1d  # optional dependency: fla (CUDA kernels)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk  # optional dependency: fla (CUDA kernels)

        outs = []
        w = weight.squeeze(1)
        for row, fctx in enumerate(ctx.fla_cp):
            x, _ = causal_conv1d(x=mixed[row:row + 1], weight=w, activation="silu", backend="triton",
                                 cp_context=fctx)
            q, k, v = x.split(sizes, dim=-1)
            T = q.shape[1]
            q = q.reshape(1, T, -1, self.key_head_dim)
            k = k.reshape(1, T, -1, self.key_head_dim)
            v = v.reshape(1, T, -1, self.value_head_dim)
            q, k = _expand_heads(q, k, v)
            o, _ = fla_chunk(q, k, v, g[row:row + 1], beta[row:row + 1], use_qk_l2norm_in_kernel=True,
                             cp_context=fctx)
            outs.append(o)
        return torch.cat(outs, dim=0)
