"""Gradient-in-forward schedule of the fused LM head (backend ``fwdgrad``): three GEMM-sized
passes instead of the recompute path's four.

For each chunk of ``T = chunk_tokens`` tokens (the [T, V_local] logits buffer is the only
[tokens, *] buffer):

1. ``Z = H_c @ W^T`` on cuBLAS (bf16 inputs, fp32 accumulation; Z stored in ``logits_dtype``);
2. one row kernel (Triton on CUDA or under TRITON_INTERPRET=1, torch otherwise) reads each row
   of Z: log-sum-exp, target logit, (sum of logits, E_p[s] when asked), the loss, and the logit
   gradient ``G = inv_temp * (a p + b p s + c onehot + d)`` written over Z in place (in the
   input dtype: a bf16 G over an fp32 Z goes into the front half of each row, no new buffer);
3. ``dH_c = G @ W`` (one GEMM, K = V) and ``dW += G^T @ H_c`` (accumulated over the chunks in
   ``dw_accum``: fp32 through cuBLAS's bf16-in/fp32-out GEMM with beta = 1, or in the
   weight's dtype).

The gradients are stored for the upstream gradient: the caller's autograd backward multiplies
them by the (scalar) upstream gradient, so loss scaling and gradient accumulation stay exact.
A per-token upstream gradient cannot be applied to a stored dW, so ``reduction="none"`` and
``token_logprobs`` keep the recompute path (linear_ce.py, logprob.py).

Vocabulary sharding: for a chunk, each rank's row kernel writes partial statistics (max,
sum-exp, target, sums), two all-reduces of [T] vectors combine them into the global lse, then a
second row kernel writes G; dH is all-reduced once at the end, dW stays local. The same
two-kernel path serves callers that derive the per-token coefficients a, b, c, d from the
statistics in torch (the fused RL objectives, ``coef_fn``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from components.losses.lm_head import engine
from components.losses.lm_head.knobs import KERNEL, chunk_tokens_for  # the launch knobs (benchmarks set them here too)

LOGITS_DTYPES = ("bfloat16", "float32")
DW_ACCUM = ("float32", "weight")

# Which cuBLAS fallbacks ran (an fp32 temporary instead of bf16-in/fp32-out in place); the
# benchmark prints it.
FALLBACKS: set[str] = set()


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def estimate_bytes(n: int, hd: int, v_local: int, logits_dtype: str, dw_accum: str, chunk_tokens: int,
                   elt: int = 2) -> int:
    """Extra bytes the schedule holds at its peak (logits chunk + dW accumulator + dH)."""
    t = chunk_tokens_for(n, chunk_tokens)
    z = t * v_local * (4 if logits_dtype == "float32" else 2) * (2 if int(KERNEL.get("streams", 1)) == 2 else 1)
    dw = v_local * hd * (4 if dw_accum == "float32" else elt)
    return z + dw + n * hd * elt


@dataclass
class CE:
    """Cross-entropy coefficients computed inside the row kernel (no torch work per chunk)."""

    z_loss: float
    label_smoothing: float


@dataclass
class Result:
    lse: torch.Tensor  # [N] fp32
    target: torch.Tensor  # [N] fp32 (0 where ignored / not owned)
    sum_s: torch.Tensor | None
    mean_s: torch.Tensor | None
    loss: torch.Tensor | None  # [N] fp32 (CE only; 0 at ignored tokens)
    dh: torch.Tensor | None  # [N, H] (h dtype, or fp32 under a vocabulary group before its all-reduce)
    dw: torch.Tensor | None  # [V_local, H] fp32 or weight dtype


def _mm_out(a, b, out, out_dtype=None):
    """cuBLAS a @ b into ``out`` (fp32 out from bf16 inputs when out is fp32)."""
    if out.dtype == a.dtype:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=out.dtype, out=out)
        except (NotImplementedError, RuntimeError, TypeError):  # no mm.dtype_out: a temporary
            FALLBACKS.add("mm out_dtype")
            return out.copy_(torch.mm(a, b, out_dtype=out.dtype))
    return out.copy_(a.float() @ b.float())


def _addmm_(c, a, b):
    """c += a @ b (cuBLAS beta = 1; fp32 c from bf16 a, b without an fp32 copy of the inputs)."""
    if c.dtype == a.dtype:
        return c.addmm_(a, b)
    if a.is_cuda:
        try:
            return torch.addmm(c, a, b, out_dtype=c.dtype, out=c)
        except (NotImplementedError, RuntimeError, TypeError):  # no addmm.dtype_out: a temporary
            FALLBACKS.add("addmm out_dtype")
            return c.add_(torch.mm(a, b, out_dtype=c.dtype))
    return c.add_(a.float() @ b.float())


def run(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, *, shard: engine.Shard, ignore_index: int,
        inv_temp: float, ce: CE | None = None, coef_fn: Callable | None = None,
        scale_fn: Callable | None = None, need_sum: bool = False,
        need_ps: bool = False, need_dh: bool, need_dw: bool, logits_dtype: str = "bfloat16",
        dw_accum: str = "float32", chunk_tokens: int = 4096) -> Result:
    """The schedule above. Exactly one of ``ce`` (cross-entropy, coefficients in the kernel) and
    ``coef_fn(t0, t1, lse, target, mean_s) -> (a, b | None, c, d)`` (per-token [T] fp32 tensors of
    the chunk, for dL/ds) is given. ``scale_fn(t0, t1, lse, target) -> r`` ([T] fp32, with
    coef_fn, used when no vocabulary group is given) says that the gradient is ``r_t`` times
    cross-entropy's ``(p - onehot) / T`` (log-prob objectives without an entropy term): then the
    single fused kernel writes cross-entropy's G and r scales the [T, H] sides of the two
    gradient GEMMs (dH_c = r (G W), dW += G^T (r H_c)) instead of another pass over the logits."""
    assert (ce is None) != (coef_fn is None)
    n, hd = h.shape
    v = w.shape[0]
    dev = h.device
    f32 = dict(device=dev, dtype=torch.float32)
    lab = engine.local_labels(labels, shard, ignore_index)
    valid = labels != ignore_index
    grad = need_dh or need_dw
    if ce is not None:  # the fused kernel folds smoothing in; the sharded path needs the sums
        need_sum = shard.group is not None and ce.label_smoothing > 0
    wk = w if w.dtype == h.dtype else w.to(h.dtype)
    # fp32/fp64 inputs: logits in their dtype (no bf16 anywhere); bf16/fp16 inputs: as asked.
    wide = h.dtype.itemsize >= 4
    zdt = h.dtype if wide else (torch.float32 if logits_dtype == "float32" else h.dtype)
    tc = chunk_tokens_for(n, chunk_tokens)
    two = h.is_cuda and int(KERNEL.get("streams", 1)) == 2 and shard.group is None and grad and n > tc
    zbufs = [torch.empty(tc * v, device=dev, dtype=zdt) for _ in range(2 if two else 1)]
    if two:
        main, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
        free = [None, None]
    lse = torch.empty(n, **f32)
    tgt = torch.empty(n, **f32)
    ssum = torch.empty(n, **f32) if need_sum else None
    mps = torch.empty(n, **f32) if need_ps else None
    fused_ce = (ce is not None or scale_fn is not None) and shard.group is None
    if ce is None:
        ce = CE(0.0, 0.0) if fused_ce else None
    loss = torch.empty(n, **f32) if ce is not None else None
    dh_dtype = torch.float32 if (shard.group is not None and not wide) else h.dtype
    dh = torch.empty((n, hd), device=dev, dtype=dh_dtype) if need_dh else None
    dw = None
    if need_dw:
        acc = torch.float32 if (dw_accum == "float32" and w.dtype.itemsize < 4) else w.dtype
        dw = torch.empty((v, hd), device=dev, dtype=acc)
    triton_ok = use_triton(h)
    if triton_ok:
        from components.losses.lm_head import triton_fwdgrad  # optional dependency: triton (CUDA or its interpreter)
    for i, t0 in enumerate(range(0, n, tc)):
        t1 = min(n, t0 + tc)
        rows = t1 - t0
        zbuf = zbufs[i % len(zbufs)]
        if two and free[i % 2] is not None:
            main.wait_event(free[i % 2])  # the GEMMs of chunk i - 2 are done with this buffer
        z = zbuf[: rows * v].view(rows, v)
        hc = h[t0:t1]
        _mm_out(hc, wk.T, z)
        # gradient view: in place over z (same dtype) or the front half of each fp32 row (bf16 G)
        g_view = None
        if grad:
            g_view = z if h.dtype == zdt else zbuf.view(h.dtype)[: rows * v * 2].view(rows, 2 * v)[:, :v]
        sl = slice(t0, t1)
        scale = None
        if fused_ce:
            z_loss, eps = ce.z_loss, ce.label_smoothing
            if triton_ok:
                triton_fwdgrad.ce_rows(z, g_view, lab[sl], lse[sl], tgt[sl], loss[sl], inv_temp, z_loss, eps, v, grad)
            else:
                _torch_ce_rows(z, g_view, lab[sl], lse[sl], tgt[sl], loss[sl], inv_temp, z_loss, eps, v)
            if scale_fn is not None and grad:
                scale = scale_fn(t0, t1, lse[sl], tgt[sl]).float()
        else:
            stats_rows = triton_fwdgrad.stats_rows if triton_ok else _torch_stats_rows
            part = stats_rows(z, lab[sl], inv_temp, need_sum, need_ps)
            m, se, t_, ss_, sps_ = part
            if shard.group is not None:
                mx = m.clone()
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=shard.group)
                sc = torch.exp(m - mx)
                packed = [se * sc, t_] + ([ss_] if need_sum else []) + ([sps_ * sc] if need_ps else [])
                packed = torch.stack(packed)
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=shard.group)
                se, t_ = packed[0], packed[1]
                j = 2
                if need_sum:
                    ss_, j = packed[j], j + 1
                if need_ps:
                    sps_ = packed[j]
                m = mx
            lse[sl] = m + torch.log(se)
            tgt[sl] = torch.where(valid[sl], t_, torch.zeros_like(t_))
            if need_sum:
                ssum[sl] = ss_
            if need_ps:
                mps[sl] = sps_ / se
            if ce is not None:
                eps = ce.label_smoothing
                vl = valid[sl].float()
                ls = lse[sl]
                per = ls - (1 - eps) * tgt[sl] + ce.z_loss * ls * ls
                if eps > 0:
                    per = per - (eps / shard.total) * ssum[sl]
                loss[sl] = per * vl
                a, b, c, d = vl * (1 + 2 * ce.z_loss * ls), None, -(1 - eps) * vl, -(eps / shard.total) * vl
            elif grad:
                a, b, c, d = coef_fn(t0, t1, lse[sl], tgt[sl], mps[sl] if need_ps else None)
            if grad:
                a, c, d = (x.float().contiguous() for x in (a, c, d))
                b = b.float().contiguous() if b is not None else None
                grad_rows = triton_fwdgrad.grad_rows if triton_ok else _torch_grad_rows
                grad_rows(z, g_view, lab[sl], lse[sl], a, b, c, d, inv_temp)
        if two:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                _grad_gemms(g_view, wk, hc, dh, dw, sl, i, scale)
                free[i % 2] = side.record_event()
        else:
            _grad_gemms(g_view, wk, hc, dh, dw, sl, i, scale)
    if two:
        main.wait_stream(side)
    del zbufs
    zbuf = z = g_view = None  # noqa: F841 (free the logits buffer before the all-reduce)
    if need_dw and n == 0:
        dw.zero_()
    if need_dh and shard.group is not None:
        dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=shard.group)
    return Result(lse, tgt, ssum, mps, loss, dh, dw)


def _grad_gemms(g, wk, hc, dh, dw, sl, i, scale=None):
    if scale is not None:  # G_true = scale * G, row by row: scale the [T, H] sides
        if dh is not None:
            tmp = torch.empty((g.shape[0], wk.shape[1]), device=g.device, dtype=torch.float32)
            _mm_out(g, wk, tmp)
            dh[sl] = tmp.mul_(scale[:, None])
        hc = (hc.float() * scale[:, None]).to(hc.dtype)
        dh = None
    if dh is not None:
        _mm_out(g, wk, dh[sl])
    if dw is not None:
        if i == 0:
            _mm_out(g.T, hc, dw)
        else:
            _addmm_(dw, g.T, hc)


# ---- torch versions of the row kernels (CPU; the same arithmetic in fp32) ----------------------


def _torch_stats_rows(z, lab, inv_temp, need_sum, need_ps):
    s = z.float() * inv_temp
    m = s.amax(1)
    e = torch.exp(s - m[:, None])
    se = e.sum(1)
    hit = lab >= 0
    t = torch.where(hit, s.gather(1, lab.clamp_min(0)[:, None]).squeeze(1), torch.zeros_like(m))
    ss = s.sum(1) if need_sum else None
    sps = (e * s).sum(1) if need_ps else None
    return m, se, t, ss, sps


def _torch_grad_rows(z, g_out, lab, lse, a, b, c, d, inv_temp):
    s = z.float() * inv_temp
    p = torch.exp(s - lse[:, None])
    g = a[:, None] * p + d[:, None]
    if b is not None:
        g = g + b[:, None] * p * s
    rows = torch.nonzero(lab >= 0).squeeze(1)
    g[rows, lab[rows]] += c[rows]
    g_out.copy_(g * inv_temp)


def _torch_ce_rows(z, g_out, lab, lse, tgt, loss, inv_temp, z_loss, eps, v_total):
    m, se, t, ss, _ = _torch_stats_rows(z, lab, inv_temp, eps > 0, False)
    lse.copy_(m + torch.log(se))
    vl = (lab >= 0).float()
    tgt.copy_(t * vl)
    per = lse - (1 - eps) * tgt + z_loss * lse * lse
    if eps > 0:
        per = per - (eps / v_total) * ss
    loss.copy_(per * vl)
    if g_out is not None:
        _torch_grad_rows(z, g_out, lab, lse, vl * (1 + 2 * z_loss * lse), None, -(1 - eps) * vl,
                         -(eps / v_total) * vl, inv_temp)


def scale_grads(res: Result, g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, need_dh: bool, need_dw: bool):
    """(dH, dW) times the scalar upstream gradient g, in h's and w's dtypes (one pass each)."""
    g = g.float().reshape(())
    dh = dw = None
    if need_dh and res.dh is not None:
        dh = res.dh.mul_(g) if res.dh.dtype == h.dtype else _scale_cast(res.dh, g, torch.empty_like(h))
    if need_dw and res.dw is not None:
        dw = res.dw.mul_(g) if res.dw.dtype == w.dtype else _scale_cast(res.dw, g, torch.empty_like(w))
    return dh, dw


def _scale_cast(x, g, out):
    """out = x * g in out's dtype: one Triton pass on CUDA (torch's mixed-dtype mul is slower)."""
    if x.is_cuda and x.is_contiguous() and out.is_contiguous():
        from components.losses.lm_head import triton_fwdgrad  # optional dependency: triton (CUDA or its interpreter)

        return triton_fwdgrad.scale_cast(x, g.to(x.device), out)
    return torch.mul(x, g, out=out)


class StoredGrads(torch.autograd.Function):
    """Return ``value`` (a scalar computed in the forward) whose backward hands out the stored
    (dH, dW) of ``res`` times the upstream gradient."""

    @staticmethod
    def forward(ctx, h, w, value, res: Result):
        ctx.res, ctx.hw = res, (h, w)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, g):
        res, (h, w) = ctx.res, ctx.hw
        ctx.res = ctx.hw = None
        dh, dw = scale_grads(res, g, h, w, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dh, dw, None, None
