"""Triton row kernels of the gradient-in-forward schedule (``fwdgrad.py``). One program per
row of a [T, V] logits chunk written by cuBLAS: pass 1 reads the row (online max / sum-exp,
target logit, sums), pass 2 reads it again and writes the logit gradient over it in place.

* ``_ce_rows_kernel``: cross-entropy (z-loss, label smoothing, ignore_index, temperature) with
  its coefficients computed in the kernel: writes lse, target, loss and G in one launch;
* ``_stats_rows_kernel`` + ``_grad_rows_kernel``: the same split in two, for a vocabulary group
  (the statistics are all-reduced between the two) and for per-token coefficients a, b, c, d
  computed by the caller (RL objectives): ``G = inv_temp (a p + b p s + c onehot + d)``.

In-place safety: with G in the logits dtype each element is stored by the thread that loaded
it. A bf16 G over fp32 logits (HALF) is written into the front half of the row's bytes, which
overlaps logits loaded earlier in the same pass by other warps: a barrier before each store
orders them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.losses.lm_head.knobs import KERNEL
from components.losses.lm_head.triton_kernels import INTERPRET


def _launch():
    if INTERPRET:
        return 64, 1
    return int(KERNEL["block"]), int(KERNEL["num_warps"])


@triton.jit
def _row_stats(z_row, lab, V, inv_temp, NEED_SUM: tl.constexpr, NEED_PS: tl.constexpr, BLOCK: tl.constexpr):
    # One cross-lane reduction per step (the block max); the sums stay per lane until the end.
    cols = tl.arange(0, BLOCK)
    m = -float("inf")
    se = tl.zeros([BLOCK], tl.float32)
    ss = tl.zeros([BLOCK], tl.float32)
    sps = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, V, BLOCK):
        cc = c0 + cols
        msk = cc < V
        s = tl.load(z_row + cc, mask=msk, other=-float("inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(s - m_new)
        se = se * alpha + e
        if NEED_SUM or NEED_PS:
            s0 = tl.where(msk, s, 0.0)
            if NEED_SUM:
                ss += s0
            if NEED_PS:
                sps = sps * alpha + e * s0
        m = m_new
    tsafe = tl.maximum(lab, 0)
    t = tl.load(z_row + tsafe).to(tl.float32) * inv_temp
    t = tl.where(lab >= 0, t, 0.0)
    return m, tl.sum(se, axis=0), t, tl.sum(ss, axis=0), tl.sum(sps, axis=0)


@triton.jit
def _row_grad(z_row, g_row, lab, V, lse, a, b, c, d, inv_temp, NEED_B: tl.constexpr, HALF: tl.constexpr,
              BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    for c0 in range(0, V, BLOCK):
        cc = c0 + cols
        msk = cc < V
        s = tl.load(z_row + cc, mask=msk, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(s - lse)
        g = a * p + d
        if NEED_B:
            g += b * p * s
        g = tl.where(cc == lab, g + c, g) * inv_temp
        if HALF:
            tl.debug_barrier()
        tl.store(g_row + cc, g.to(g_row.dtype.element_ty), mask=msk)


@triton.jit
def _ce_rows_kernel(z_ptr, ldz, g_ptr, ldg, lab_ptr, lse_ptr, t_ptr, loss_ptr, V, inv_temp, z_loss, eps,
                    v_total, WRITE_G: tl.constexpr, SMOOTH: tl.constexpr, HALF: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * ldz
    lab = tl.load(lab_ptr + row).to(tl.int64)
    m, se, t, ss, _ = _row_stats(z_row, lab, V, inv_temp, SMOOTH, False, BLOCK)
    lse = m + tl.log(se)
    valid = lab >= 0
    vl = tl.where(valid, 1.0, 0.0)
    loss = lse - (1.0 - eps) * t + z_loss * lse * lse
    if SMOOTH:
        loss -= (eps / v_total) * ss
    tl.store(lse_ptr + row, lse)
    tl.store(t_ptr + row, t * vl)
    tl.store(loss_ptr + row, loss * vl)
    if WRITE_G:
        a = vl * (1.0 + 2.0 * z_loss * lse)
        c = -(1.0 - eps) * vl
        d = -(eps / v_total) * vl
        _row_grad(z_row, g_ptr + row * ldg, lab, V, lse, a, 0.0, c, d, inv_temp, False, HALF, BLOCK)


@triton.jit
def _stats_rows_kernel(z_ptr, ldz, lab_ptr, m_ptr, se_ptr, t_ptr, ss_ptr, sps_ptr, V, inv_temp,
                       NEED_SUM: tl.constexpr, NEED_PS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lab = tl.load(lab_ptr + row).to(tl.int64)
    m, se, t, ss, sps = _row_stats(z_ptr + row * ldz, lab, V, inv_temp, NEED_SUM, NEED_PS, BLOCK)
    tl.store(m_ptr + row, m)
    tl.store(se_ptr + row, se)
    tl.store(t_ptr + row, t)
    if NEED_SUM:
        tl.store(ss_ptr + row, ss)
    if NEED_PS:
        tl.store(sps_ptr + row, sps)


@triton.jit
def _grad_rows_kernel(z_ptr, ldz, g_ptr, ldg, lab_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, d_ptr, V, inv_temp,
                      NEED_B: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lab = tl.load(lab_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    a = tl.load(a_ptr + row)
    c = tl.load(c_ptr + row)
    d = tl.load(d_ptr + row)
    b = 0.0
    if NEED_B:
        b = tl.load(b_ptr + row)
    _row_grad(z_ptr + row * ldz, g_ptr + row * ldg, lab, V, lse, a, b, c, d, inv_temp, NEED_B, HALF, BLOCK)


@triton.jit
def _scale_cast_kernel(x_ptr, g_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = i < n
    g = tl.load(g_ptr)
    x = tl.load(x_ptr + i, mask=msk, other=0.0)
    tl.store(y_ptr + i, (x * g).to(y_ptr.dtype.element_ty), mask=msk)


def scale_cast(x: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = (x * g) in out's dtype, one pass (x fp32 contiguous, g a 0-dim fp32 tensor on x's device)."""
    n = x.numel()
    block = 8192
    _scale_cast_kernel[(triton.cdiv(n, block),)](x, g, out, n, BLOCK=block, num_warps=8)
    return out


def _half(z, g):
    return g is not None and g.dtype != z.dtype


def ce_rows(z, g, lab, lse, tgt, loss, inv_temp, z_loss, eps, v_total, write_g):
    rows, v = z.shape
    block, warps = _launch()
    _ce_rows_kernel[(rows,)](z, z.stride(0), g if g is not None else z, g.stride(0) if g is not None else 0,
                             lab, lse, tgt, loss, v, float(inv_temp), float(z_loss), float(eps), float(v_total),
                             WRITE_G=bool(write_g and g is not None), SMOOTH=eps > 0, HALF=_half(z, g),
                             BLOCK=block, num_warps=warps)


def stats_rows(z, lab, inv_temp, need_sum, need_ps):
    rows, v = z.shape
    block, warps = _launch()
    f32 = dict(device=z.device, dtype=torch.float32)
    m, se, t = torch.empty(rows, **f32), torch.empty(rows, **f32), torch.empty(rows, **f32)
    ss = torch.empty(rows, **f32) if need_sum else m
    sps = torch.empty(rows, **f32) if need_ps else m
    _stats_rows_kernel[(rows,)](z, z.stride(0), lab, m, se, t, ss, sps, v, float(inv_temp), NEED_SUM=need_sum,
                                NEED_PS=need_ps, BLOCK=block, num_warps=warps)
    return m, se, t, (ss if need_sum else None), (sps if need_ps else None)


def grad_rows(z, g, lab, lse, a, b, c, d, inv_temp):
    rows, v = z.shape
    block, warps = _launch()
    _grad_rows_kernel[(rows,)](z, z.stride(0), g, g.stride(0), lab, lse, a, b if b is not None else a, c, d, v,
                               float(inv_temp), NEED_B=b is not None, HALF=_half(z, g), BLOCK=block,
                               num_warps=warps)
