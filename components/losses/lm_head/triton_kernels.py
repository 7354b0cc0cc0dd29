"""Triton kernels for the fused LM head (linear_ce, logprob). Imported only for CUDA tensors
or under Triton's CPU interpreter (TRITON_INTERPRET=1); the math they implement is written
out, in torch, in ``components.losses.lm_head.engine`` (the reference path).

Backend "triton": two kernels, both tile-by-tile over ``z = hidden @ weight^T`` with fp32
accumulation:

* ``_stats_kernel`` (forward): grid = (token tiles, vocab splits). Each program walks the
  vocabulary tiles of its split, keeps an online max / sum-exp per token, gathers the target
  logit, and optionally the plain logit sum (label smoothing) and sum(exp * s) (entropy).
  Nothing of size [tokens, vocab] is written: the outputs are [splits, tokens] partials,
  combined in torch. Splitting the vocabulary keeps all SMs busy at small token counts.

* ``_dz_kernel`` (backward): recomputes z for one vocabulary slice [v0, v0 + Vc) and writes
  the logit gradient ``dz = inv_temp * (a*p + b*p*s + c*[v == y] + d)`` (p = exp(s - lse),
  s = z * inv_temp; a, b, c, d per token) into a bounded workspace [tokens, Vc] in the
  input dtype. The caller then runs the two gradient GEMMs (dz @ W_slice, dz^T @ h) on
  cuBLAS. The workspace is the only [tokens, *] buffer and its size is capped
  (``workspace_mb``), independent of the vocabulary size.

Backend "cublas" (and the statistics of "mixed"): cuBLAS writes fp32 logits of one vocabulary
slice into the workspace; ``_slice_stats_kernel`` folds the slice into running per-token
statistics (in place, [N] vectors) and ``_slice_dz_kernel`` turns it into dz.

Interpreter note: Triton 3.8's interpreter computes ``tl.dot`` on bf16 tiles wrongly (checked
here: errors of ~1e10); with ``UPCAST`` the tiles are converted to fp32 before the dot, which
is exact for bf16 products (a bf16 x bf16 product fits in fp32) and is what the interpreter
uses. On GPUs UPCAST is off and tensor cores take bf16 directly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _configs(kind: str):
    if INTERPRET:
        extra = {} if kind == "stats" else {"GROUP": 2}
        return [triton.Config({"BN": 16, "BV": 32, "BK": 16, **extra}, num_warps=4, num_stages=1)]
    if kind == "stats":
        return [
            triton.Config({"BN": 128, "BV": 128, "BK": 64}, num_warps=8, num_stages=3),
            triton.Config({"BN": 128, "BV": 256, "BK": 64}, num_warps=8, num_stages=3),
            triton.Config({"BN": 64, "BV": 256, "BK": 64}, num_warps=8, num_stages=4),
        ]
    return [
        triton.Config({"BN": 128, "BV": 128, "BK": 64, "GROUP": 8}, num_warps=8, num_stages=3),
        triton.Config({"BN": 128, "BV": 256, "BK": 64, "GROUP": 8}, num_warps=8, num_stages=3),
        triton.Config({"BN": 256, "BV": 128, "BK": 64, "GROUP": 8}, num_warps=8, num_stages=3),
    ]


def _prune_small(configs, named_args, **kwargs):
    """Drop tiles far larger than the problem (tiny test shapes); keep at least one."""
    n, v = named_args["N"], named_args["V"]
    keep = [c for c in configs if c.kwargs["BN"] <= max(16, triton.next_power_of_2(n))
            and c.kwargs["BV"] <= max(32, triton.next_power_of_2(v))]
    return keep or configs[:1]


@triton.jit
def _logit_tile(h_ptr, w_ptr, rn, rmask, rv, vmask, K, stride_h, stride_w,
                UPCAST: tl.constexpr, PREC: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr):
    """fp32 [BN, BV] tile of h[rn] @ w[rv]^T, accumulated over K in BK steps."""
    rk0 = tl.arange(0, BK)
    acc = tl.zeros([BN, BV], tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + rk0
        kmask = rk < K
        h = tl.load(h_ptr + rn[:, None] * stride_h + rk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + rv[:, None] * stride_w + rk[None, :], mask=vmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(h.dtype)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PREC)
    return acc


@triton.jit
def _fold_tile(m, se, tgt, ssum, sps, s, cmask, cols, lab, NEED_SUM: tl.constexpr, NEED_PS: tl.constexpr):
    """Each row's online softmax statistics updated with one [rows, cols] tile of scaled logits ``s``
    (``cols``: their local vocabulary columns, ``cmask``: the real ones): running max, sum of exp,
    the label's logit and, when asked, the sum of logits and the exp-weighted sum of logits."""
    s_valid = tl.where(cmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s_valid, axis=1))
    alpha = tl.exp(m - m_new)
    e = tl.exp(s_valid - m_new[:, None])
    se = se * alpha + tl.sum(e, axis=1)
    s_zero = tl.where(cmask[None, :], s, 0.0)
    if NEED_PS:
        sps = sps * alpha + tl.sum(e * s_zero, axis=1)
    if NEED_SUM:
        ssum += tl.sum(s_zero, axis=1)
    tgt += tl.sum(tl.where(cols[None, :] == lab[:, None], s_zero, 0.0), axis=1)
    return m_new, se, tgt, ssum, sps


@triton.jit
def _dz_tile(s, rn, rmask, cols, lab_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, d_ptr, inv_temp, NEED_B: tl.constexpr):
    """dL/dz of one [rows, cols] tile of scaled logits ``s``: inv_temp * (a p + b p s + c [col == label] + d),
    with the per-token coefficients a, b, c, d and lse read at rows ``rn``."""
    lse = tl.load(lse_ptr + rn, mask=rmask, other=0.0)
    a = tl.load(a_ptr + rn, mask=rmask, other=0.0)
    c = tl.load(c_ptr + rn, mask=rmask, other=0.0)
    d = tl.load(d_ptr + rn, mask=rmask, other=0.0)
    lab = tl.load(lab_ptr + rn, mask=rmask, other=-1)
    p = tl.exp(s - lse[:, None])
    g = a[:, None] * p + d[:, None]
    if NEED_B:
        b = tl.load(b_ptr + rn, mask=rmask, other=0.0)
        g += b[:, None] * p * s
    g += tl.where(cols[None, :] == lab[:, None], c[:, None], 0.0)
    return g * inv_temp


@triton.autotune(configs=_configs("stats"), key=["K", "NB", "NEED_SUM", "NEED_PS"],
                 prune_configs_by={"early_config_prune": _prune_small})
@triton.jit
def _stats_kernel(h_ptr, w_ptr, lab_ptr, m_ptr, se_ptr, t_ptr, ss_ptr, sps_ptr,
                  N, V, K, NB, stride_h, stride_w, inv_temp, cols_per_split,
                  NEED_SUM: tl.constexpr, NEED_PS: tl.constexpr, UPCAST: tl.constexpr,
                  PREC: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rmask = rn < N
    lab = tl.load(lab_ptr + rn, mask=rmask, other=-1)
    m = tl.full([BN], float("-inf"), tl.float32)
    se = tl.zeros([BN], tl.float32)
    tgt = tl.zeros([BN], tl.float32)
    ssum = tl.zeros([BN], tl.float32)
    sps = tl.zeros([BN], tl.float32)
    v_begin = pid_s * cols_per_split
    v_end = tl.minimum(V, v_begin + cols_per_split)
    for vt in range(v_begin, v_end, BV):
        rv = vt + tl.arange(0, BV)
        vmask = rv < v_end
        acc = _logit_tile(h_ptr, w_ptr, rn, rmask, rv, vmask, K, stride_h, stride_w, UPCAST, PREC, BN, BV, BK)
        m, se, tgt, ssum, sps = _fold_tile(m, se, tgt, ssum, sps, acc * inv_temp, vmask, rv, lab, NEED_SUM, NEED_PS)
    out = pid_s * N + rn
    tl.store(m_ptr + out, m, mask=rmask)
    tl.store(se_ptr + out, se, mask=rmask)
    tl.store(t_ptr + out, tgt, mask=rmask)
    if NEED_SUM:
        tl.store(ss_ptr + out, ssum, mask=rmask)
    if NEED_PS:
        tl.store(sps_ptr + out, sps, mask=rmask)


@triton.autotune(configs=_configs("dz"), key=["K", "NB", "NEED_B"],
                 prune_configs_by={"early_config_prune": _prune_small})
@triton.jit
def _dz_kernel(h_ptr, w_ptr, lab_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dz_ptr,
               N, V, K, NB, v0, stride_h, stride_w, stride_dz, inv_temp,
               NEED_B: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
               BN: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    # V here is the width of this slice; columns are v0 + [0, V) of the local vocabulary.
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BN)
    n_tiles_v = tl.cdiv(V, BV)
    # Grouped ordering: GROUP token tiles share each weight tile while it sits in L2.
    per_group = GROUP * n_tiles_v
    group_id = pid // per_group
    first_n = group_id * GROUP
    group_size = tl.minimum(n_tiles_n - first_n, GROUP)
    pid_n = first_n + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size

    rn = pid_n * BN + tl.arange(0, BN)
    rmask = rn < N
    cv = pid_v * BV + tl.arange(0, BV)
    vmask = cv < V
    rv = v0 + cv
    acc = _logit_tile(h_ptr, w_ptr, rn, rmask, rv, vmask, K, stride_h, stride_w, UPCAST, PREC, BN, BV, BK)
    g = _dz_tile(acc * inv_temp, rn, rmask, rv, lab_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, d_ptr, inv_temp, NEED_B)
    tl.store(dz_ptr + rn[:, None] * stride_dz + cv[None, :], g.to(dz_ptr.dtype.element_ty),
             mask=rmask[:, None] & vmask[None, :])


@triton.jit
def _slice_stats_kernel(z_ptr, ldz, lab_ptr, m_ptr, se_ptr, t_ptr, ss_ptr, sps_ptr, N, W, v0, inv_temp,
                        FIRST: tl.constexpr, NEED_SUM: tl.constexpr, NEED_PS: tl.constexpr,
                        R: tl.constexpr, BC: tl.constexpr):
    # Running per-token statistics, updated with one fp32 logits slice z[:, :W] (columns v0 + c).
    rn = tl.program_id(0) * R + tl.arange(0, R)
    rmask = rn < N
    lab = tl.load(lab_ptr + rn, mask=rmask, other=-1)
    if FIRST:
        m = tl.full([R], float("-inf"), tl.float32)
        se = tl.zeros([R], tl.float32)
        tgt = tl.zeros([R], tl.float32)
        ssum = tl.zeros([R], tl.float32)
        sps = tl.zeros([R], tl.float32)
    else:
        m = tl.load(m_ptr + rn, mask=rmask, other=0.0)
        se = tl.load(se_ptr + rn, mask=rmask, other=0.0)
        tgt = tl.load(t_ptr + rn, mask=rmask, other=0.0)
        ssum = tl.zeros([R], tl.float32)
        sps = tl.zeros([R], tl.float32)
        if NEED_SUM:
            ssum = tl.load(ss_ptr + rn, mask=rmask, other=0.0)
        if NEED_PS:
            sps = tl.load(sps_ptr + rn, mask=rmask, other=0.0)
    for c0 in range(0, W, BC):
        cc = c0 + tl.arange(0, BC)
        cmask = cc < W
        z = tl.load(z_ptr + rn[:, None].to(tl.int64) * ldz + cc[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=float("-inf"))
        m, se, tgt, ssum, sps = _fold_tile(m, se, tgt, ssum, sps, z * inv_temp, cmask, v0 + cc, lab, NEED_SUM, NEED_PS)
    tl.store(m_ptr + rn, m, mask=rmask)
    tl.store(se_ptr + rn, se, mask=rmask)
    tl.store(t_ptr + rn, tgt, mask=rmask)
    if NEED_SUM:
        tl.store(ss_ptr + rn, ssum, mask=rmask)
    if NEED_PS:
        tl.store(sps_ptr + rn, sps, mask=rmask)


@triton.jit
def _slice_dz_kernel(z_ptr, ldz, dz_ptr, lddz, lab_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, d_ptr, N, W, v0,
                     inv_temp, NEED_B: tl.constexpr, R: tl.constexpr, BC: tl.constexpr):
    # dz = inv_temp * (a p + b p s + c [v == y] + d) from one fp32 logits slice, written in dz's dtype.
    rn = tl.program_id(0) * R + tl.arange(0, R)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rn < N
    mask = rmask[:, None] & (cc < W)[None, :]
    z = tl.load(z_ptr + rn[:, None].to(tl.int64) * ldz + cc[None, :], mask=mask, other=0.0)
    g = _dz_tile(z * inv_temp, rn, rmask, v0 + cc, lab_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, d_ptr, inv_temp, NEED_B)
    tl.store(dz_ptr + rn[:, None].to(tl.int64) * lddz + cc[None, :], g.to(dz_ptr.dtype.element_ty), mask=mask)


def _bucket(n: int) -> int:
    """Autotuning key for the token count: tiny (tests), small, large. Not N itself, so that
    varying RL batch lengths do not retune on every new length."""
    return 0 if n < 256 else (1 if n < 4096 else 2)


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no TF32), like torch's default matmul.
    return "ieee" if dtype == torch.float32 else "tf32"


def _num_sms(device: torch.device) -> int:
    if INTERPRET:
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def stats(h: torch.Tensor, w: torch.Tensor, lab_local: torch.Tensor, inv_temp: float,
          need_sum: bool, need_ps: bool):
    """Per-token partial statistics over this weight's rows; see module docstring.

    Returns (m, se, tgt, ssum | None, sps | None), each [splits, N] fp32.
    """
    n, k = h.shape
    v = w.shape[0]
    sms = _num_sms(h.device)
    min_bn = 16 if INTERPRET else 64
    n_tiles_n = triton.cdiv(n, min_bn)
    v_tiles = triton.cdiv(v, 256 if not INTERPRET else 32)
    splits = max(1, min(v_tiles, triton.cdiv(2 * sms, n_tiles_n)))
    # Split boundaries on multiples of every BV in the configs, so no tile straddles two splits.
    unit = 32 if INTERPRET else 256
    cols_per_split = triton.cdiv(triton.cdiv(v, splits), unit) * unit
    splits = triton.cdiv(v, cols_per_split)
    f32 = dict(device=h.device, dtype=torch.float32)
    m = torch.empty((splits, n), **f32)
    se = torch.empty((splits, n), **f32)
    tgt = torch.empty((splits, n), **f32)
    ssum = torch.empty((splits, n), **f32) if need_sum else m
    sps = torch.empty((splits, n), **f32) if need_ps else m

    def grid(meta):
        return (triton.cdiv(n, meta["BN"]), splits)

    _stats_kernel[grid](h, w, lab_local, m, se, tgt, ssum, sps, n, v, k, _bucket(n), h.stride(0), w.stride(0),
                        inv_temp, cols_per_split, NEED_SUM=need_sum, NEED_PS=need_ps,
                        UPCAST=INTERPRET, PREC=_prec(h.dtype))
    return m, se, tgt, (ssum if need_sum else None), (sps if need_ps else None)


def dz_slice(h, w, lab_local, lse, a, b, c, d, v0: int, v1: int, out: torch.Tensor,
             inv_temp: float) -> torch.Tensor:
    """Write dz for local vocabulary columns [v0, v1) into ``out`` ([N, >= v1 - v0])."""
    n, k = h.shape
    width = v1 - v0

    def grid(meta):
        return (triton.cdiv(n, meta["BN"]) * triton.cdiv(width, meta["BV"]),)

    _dz_kernel[grid](h, w, lab_local, lse, a, b if b is not None else a, c, d, out,
                     n, width, k, _bucket(n), v0, h.stride(0), w.stride(0), out.stride(0), inv_temp,
                     NEED_B=b is not None, UPCAST=INTERPRET, PREC=_prec(h.dtype))
    return out


# ---- "cublas" implementation: logits slices from cuBLAS (fp32 output), Triton for the rest ----

_ROWS, _COLS = (4, 32) if INTERPRET else (4, 1024)


def slice_stats(z: torch.Tensor, lab_local, v0: int, inv_temp: float, acc, first: bool):
    """Fold the fp32 logits slice z [N, W] (columns v0 + [0, W)) into the running statistics
    ``acc`` = (m, se, tgt, ssum | None, sps | None), each [N] fp32, in place."""
    n, width = z.shape
    m, se, tgt, ssum, sps = acc
    _slice_stats_kernel[(triton.cdiv(n, _ROWS),)](
        z, z.stride(0), lab_local, m, se, tgt, ssum if ssum is not None else m, sps if sps is not None else m,
        n, width, v0, inv_temp, FIRST=first, NEED_SUM=ssum is not None, NEED_PS=sps is not None,
        R=_ROWS, BC=_COLS, num_warps=4)


def slice_dz(z: torch.Tensor, out: torch.Tensor, lab_local, lse, a, b, c, d, v0: int, inv_temp: float):
    n, width = z.shape
    rows = 16 if not INTERPRET else 4
    cols = 256 if not INTERPRET else 32
    _slice_dz_kernel[(triton.cdiv(n, rows), triton.cdiv(width, cols))](
        z, z.stride(0), out, out.stride(0), lab_local, lse, a, b if b is not None else a, c, d, n, width, v0,
        inv_temp, NEED_B=b is not None, R=rows, BC=cols, num_warps=4)
