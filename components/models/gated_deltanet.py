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

logger = logging.getLogger(__name__)

CHUNK = 64


# --------------------------------------------------------------------------- torch kernel

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _chunk_pieces(q, k, v, g, beta, resets, scale, chunk):
    """Per-chunk closed forms. Inputs [B, T, H, *] fp32, T a multiple of ``chunk``.

    Returns, per chunk n (shapes [B, H, N, ...]):
      o_intra [C, V]: output with a zero starting state;  p [C, K]: o = o_intra + p @ S_start
      m [K, K], b [K, V]: S_end = m @ S_start + b
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    N, C = T // chunk, chunk

    def split(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.transpose(1, 2)
        return x.reshape(B, H, N, C, *x.shape[3:])

    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    if resets is None:
        seg = torch.zeros(B, 1, N, C, dtype=torch.int64, device=k.device)
    else:
        seg = resets.reshape(B, 1, N, C).to(torch.int64).cumsum(-1)  # 0: continues the chunk's start
    cg = g.cumsum(-1)  # [B, H, N, C]
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)  # [B, 1, N, C, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    allowed = same & causal
    diff = cg.unsqueeze(-1) - cg.unsqueeze(-2)
    decay = torch.where(allowed, diff, torch.full_like(diff, float("-inf"))).exp()  # [B, H, N, C, C]
    start = torch.where(seg == 0, cg, torch.full_like(cg, float("-inf"))).exp()  # decay from the chunk start

    kk = k @ k.transpose(-1, -2)
    strict = decay * (1 - torch.eye(C, device=k.device, dtype=k.dtype))
    a = beta.unsqueeze(-1) * kk * strict
    eye = torch.eye(C, device=k.device, dtype=k.dtype)
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * start).unsqueeze(-1) * k], dim=-1)
    sol = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u0, w = sol[..., :V], sol[..., V:]  # u = u0 - w @ S_start

    qk = (q @ k.transpose(-1, -2)) * decay
    o_intra = scale * (qk @ u0)
    p = scale * (start.unsqueeze(-1) * q - qk @ w)
    last = decay[..., -1, :].unsqueeze(-1) * k  # [B, H, N, C, K]: k_j decayed to the chunk end
    b = last.transpose(-1, -2) @ u0
    m = torch.diag_embed(start[..., -1].unsqueeze(-1).expand(*start.shape[:-1], K)) - last.transpose(-1, -2) @ w
    return o_intra, p, m, b


def _scan(m, b, s0):
    """Chunk-start states: S_0 = s0, S_{n+1} = m_n S_n + b_n. Returns ([B, H, N, K, V], final)."""
    states, s = [], s0
    for n in range(m.shape[2]):
        states.append(s)
        s = m[:, :, n] @ s + b[:, :, n]
    return torch.stack(states, dim=2), s


def _compose(m, b):
    """The affine map of a whole run of chunks: S_end = M S_start + bb."""
    M = torch.eye(m.shape[-1], device=m.device, dtype=m.dtype).expand_as(m[:, :, 0])
    bb = torch.zeros_like(b[:, :, 0])
    for n in range(m.shape[2]):
        M = m[:, :, n] @ M
        bb = m[:, :, n] @ bb + b[:, :, n]
    return M, bb


class _Prepared:
    """A segment of tokens turned into chunk pieces, ready to run from any starting state."""

    def __init__(self, q, k, v, g, beta, resets, scale, chunk=CHUNK):
        T = k.shape[1]
        pad = (-T) % chunk
        f32 = [x.float() for x in (q, k, v, g, beta)]
        if pad:
            f32 = [F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in f32]
            if resets is not None:
                resets = F.pad(resets, (0, pad))
        self.T, self.dtype = T, v.dtype
        self.o_intra, self.p, self.m, self.b = _chunk_pieces(*f32, resets, scale, chunk)

    def transition(self):
        return _compose(self.m, self.b)

    def run(self, s0):
        B, H, N, C, V = self.o_intra.shape
        if s0 is None:
            s0 = torch.zeros(B, H, self.p.shape[-1], V, device=self.p.device, dtype=self.p.dtype)
        starts, final = _scan(self.m, self.b, s0.float())
        o = self.o_intra + self.p @ starts  # [B, H, N, C, V]
        o = o.reshape(B, H, N * C, V)[:, :, : self.T].transpose(1, 2)
        return o.to(self.dtype), final


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, resets=None,
                           output_final_state=False, use_qk_l2norm=True, chunk=CHUNK):
    """Torch gated delta rule. q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV];
    resets: [B, T] bool, True where a new document starts. Returns (o [B, T, HV, V], state)."""
    q, k = _expand_heads(q, k, v)
    if use_qk_l2norm:
        q, k = l2norm(q.float()), l2norm(k.float())
    scale = scale if scale is not None else k.shape[-1] ** -0.5
    o, final = _Prepared(q, k, v, g, beta, resets, scale, chunk).run(initial_state)
    return o, (final if output_final_state else None)


def _expand_heads(q, k, v):
    if q.shape[2] != v.shape[2]:
        r = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    return q, k


# --------------------------------------------------------------------------- causal conv

def _available(resets: torch.Tensor) -> torch.Tensor:
    """Tokens of the same document before each position (capped only by the sequence start)."""
    T = resets.shape[-1]
    idx = torch.arange(T, device=resets.device).expand_as(resets)
    start = torch.where(resets, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - start


def causal_conv(x: torch.Tensor, weight: torch.Tensor, resets: torch.Tensor | None,
                halo: torch.Tensor | None = None, halo_resets: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv + SiLU that never reads across a document start.

    x [B, T, D]; weight [D, 1, W]; resets [B, T]; halo [B, W-1, D]: the inputs just before x
    in the sequence (another rank's, under CP; zeros otherwise) with their reset flags.
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    if halo is None:
        halo = x.new_zeros(B, W - 1, D)
        halo_resets = torch.zeros(B, W - 1, dtype=torch.bool, device=x.device)
        halo_resets[:, 0] = True
    if resets is None:
        resets = torch.zeros(B, T, dtype=torch.bool, device=x.device)
    xe = torch.cat([halo.to(x.dtype), x], dim=1)
    avail = _available(torch.cat([halo_resets, resets], dim=1))[:, W - 1:]  # [B, T]
    w = weight.reshape(D, W).to(x.dtype)
    out = x.new_zeros(B, T, D)
    for s in range(W):  # tap s reads x_{t-s}
        tap = xe[:, W - 1 - s: W - 1 - s + T] * w[:, W - 1 - s]
        out = out + torch.where((avail >= s).unsqueeze(-1), tap, torch.zeros_like(tap))
    return F.silu(out)


# --------------------------------------------------------------------------- CP plumbing

class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim; backward sums the gradients of every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous().unsqueeze(0)
        out = x.new_empty(world, *x.shape[1:])
        dist.all_gather_into_tensor(out, x, group=group)  # [world * 1, ...]: gloo and NCCL
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
