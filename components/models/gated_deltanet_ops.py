"""The torch path of Gated DeltaNet (any device; the CPU path): the chunked gated delta rule in closed
form per chunk (the WY form; every chunk an affine map of the state it starts from) and the causal
conv, both with document resets. components/models/gated_deltanet.py explains the recurrence and
uses them, with context parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
