"""Shared engine of the fused LM head (``linear_ce`` and ``logprob``): per-token statistics of
``s = (hidden @ weight^T) * inv_temp`` and the gradients of any loss whose logit gradient has
the form

    dL/ds_v = a * p_v + b * p_v * s_v + c * [v == y] + d          (per token: a, b, c, d)

with p = softmax(s). Cross-entropy with z-loss and label smoothing, token log-probabilities
and the entropy all have this form (see linear_ce.py and logprob.py for a, b, c, d), so one
forward pass (statistics) and one backward pass (gradients) serve both. Nothing of size
[tokens, vocab] is ever allocated:

* backend "torch" (the reference, and the CPU path): loops over vocabulary slices and token
  chunks with fp32 logits of at most [chunk_tokens, chunk_vocab];
* backend "triton" (CUDA): the statistics come from a fused kernel that keeps the logit tiles
  on chip (no logits anywhere); the backward's fused kernel recomputes the logits of one
  vocabulary slice and writes dz for it into a bounded workspace, then cuBLAS runs the two
  gradient GEMMs (dz @ W_slice, dz^T @ h) (see triton_kernels.py);
* backend "cublas" (CUDA): cuBLAS writes fp32 logits of one vocabulary slice [N, width] into
  the bounded workspace and small Triton kernels fold it into the statistics (forward) or
  turn it into dz (backward);
* backend "mixed" (CUDA, what "auto" picks): "cublas" statistics, "triton" gradients, the
  fastest pair measured on an H200 (docs/skills/linear_ce.md).
In every CUDA backend the workspace (``workspace_mb``, default 256 MiB) caps the only
[tokens, *] buffer; the vocabulary size only sets how many slices run.

Vocabulary sharding (``group``): the weight holds a contiguous slice of the vocabulary rows
(rank order, any sizes); labels are global ids. Per-token max, sum-exp, target logit and the
other sums are combined with two all-reduces of [tokens]-sized vectors; the hidden gradient
is all-reduced (the hidden input is replicated over the group), the weight gradient stays
local to the slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Shard:
    """Where this weight's rows sit in the global vocabulary."""

    start: int
    local: int
    total: int
    group: object | None = None


def vocab_shard(weight: torch.Tensor, group=None) -> Shard:
    v = weight.shape[0]
    if group is None or dist.get_world_size(group) == 1:
        return Shard(0, v, v, None)
    sizes = torch.tensor([v], dtype=torch.int64, device=weight.device)  # one [world] gather per call
    out = [torch.zeros_like(sizes) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, sizes, group=group)
    sizes = [int(x.item()) for x in out]
    rank = dist.get_rank(group)
    return Shard(sum(sizes[:rank]), v, sum(sizes), group)


def auto_backend(t: torch.Tensor) -> str:
    """Kernel family for this tensor's placement.

    NOTE for framework/devices.py: this is a kernel dispatch on where the tensor lives, not a
    device shim; it is kept here so components need no new framework API. Triton needs a CUDA
    tensor; everything else runs the torch path.
    """
    if t.is_cuda:
        try:
            import triton  # noqa: F401  (optional dependency: is triton installed?)
        except ImportError:
            return "torch"
        return "mixed"
    return "torch"


BACKENDS = ("auto", "torch", "triton", "cublas", "mixed", "fwdgrad")  # fwdgrad: _fwdgrad.py


def check_backend(backend: str, t: torch.Tensor) -> str:
    if backend == "auto":
        return auto_backend(t)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


@dataclass
class Stats:
    lse: torch.Tensor  # [N] fp32, log-sum-exp of s over the (global) vocabulary
    target: torch.Tensor  # [N] fp32, s at the label (0 where the label is ignored)
    sum_s: torch.Tensor | None  # [N] fp32, sum_v s_v
    mean_s: torch.Tensor | None  # [N] fp32, E_p[s] = sum_v p_v s_v


def local_labels(labels: torch.Tensor, shard: Shard, ignore_index: int) -> torch.Tensor:
    """Label index inside this shard's rows, or -1 (ignored, or owned by another shard)."""
    idx = labels.long() - shard.start
    own = (labels != ignore_index) & (idx >= 0) & (idx < shard.local)
    return torch.where(own, idx, torch.full_like(idx, -1)).contiguous()


def _torch_stats(h, w, lab, inv_temp, need_sum, need_ps, chunk_tokens, chunk_vocab):
    n, v = h.shape[0], w.shape[0]
    f32 = dict(device=h.device, dtype=torch.float32)
    m = torch.full((n,), -math.inf, **f32)
    se = torch.zeros(n, **f32)
    tgt = torch.zeros(n, **f32)
    ssum = torch.zeros(n, **f32) if need_sum else None
    sps = torch.zeros(n, **f32) if need_ps else None
    for v0 in range(0, v, chunk_vocab):
        v1 = min(v, v0 + chunk_vocab)
        wc = w[v0:v1].float()
        for t0 in range(0, n, chunk_tokens):
            t1 = min(n, t0 + chunk_tokens)
            s = (h[t0:t1].float() @ wc.T) * inv_temp
            mo = m[t0:t1]
            mn = torch.maximum(mo, s.amax(dim=1))
            alpha = torch.exp(mo - mn)
            e = torch.exp(s - mn[:, None])
            se[t0:t1] = se[t0:t1] * alpha + e.sum(dim=1)
            if need_ps:
                sps[t0:t1] = sps[t0:t1] * alpha + (e * s).sum(dim=1)
            if need_sum:
                ssum[t0:t1] += s.sum(dim=1)
            li = lab[t0:t1] - v0
            hit = (li >= 0) & (li < v1 - v0)
            got = s.gather(1, li.clamp(0, v1 - v0 - 1)[:, None]).squeeze(1)
            tgt[t0:t1] += torch.where(hit, got, torch.zeros_like(got))
            m[t0:t1] = mn
    return m[None], se[None], tgt[None], (ssum[None] if need_sum else None), (sps[None] if need_ps else None)


def statistics(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, *, shard: Shard,
               ignore_index: int, inv_temp: float, need_sum: bool, need_ps: bool,
               backend: str, chunk_tokens: int, chunk_vocab: int, workspace_mb: float = 256.0) -> Stats:
    """Forward pass: per-token statistics, combined over vocabulary splits and shards."""
    lab = local_labels(labels, shard, ignore_index)
    if backend == "triton":
        from components.losses.lm_head import triton_kernels  # optional dependency: triton (CUDA or its interpreter)

        m, se, tgt, ssum, sps = triton_kernels.stats(h, w, lab, inv_temp, need_sum, need_ps)
    elif backend in ("cublas", "mixed"):
        m, se, tgt, ssum, sps = _cublas_stats(h, w, lab, inv_temp, need_sum, need_ps, workspace_mb)
    else:
        m, se, tgt, ssum, sps = _torch_stats(h, w, lab, inv_temp, need_sum, need_ps,
                                             chunk_tokens, chunk_vocab)
    # Combine the [splits, N] partials: first within this rank, then across vocabulary shards.
    mx = m.amax(dim=0)
    if shard.group is not None:
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=shard.group)
    scale = torch.exp(m - mx[None])
    parts = [(se * scale).sum(0), tgt.sum(0)]
    if need_sum:
        parts.append(ssum.sum(0))
    if need_ps:
        parts.append((sps * scale).sum(0))
    packed = torch.stack(parts)
    if shard.group is not None:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=shard.group)
    se_t, tgt_t = packed[0], packed[1]
    lse = mx + torch.log(se_t)
    i = 2
    sum_s = mean_s = None
    if need_sum:
        sum_s, i = packed[i], i + 1
    if need_ps:
        mean_s = packed[i] / se_t
    valid = labels != ignore_index
    tgt_t = torch.where(valid, tgt_t, torch.zeros_like(tgt_t))
    return Stats(lse=lse, target=tgt_t, sum_s=sum_s, mean_s=mean_s)


def _torch_grads(h, w, lab, lse, a, b, c, d, inv_temp, need_dh, need_dw, chunk_tokens, chunk_vocab):
    n, k = h.shape
    v = w.shape[0]
    dh = torch.zeros((n, k), device=h.device, dtype=torch.float32) if need_dh else None
    dw = torch.empty_like(w) if need_dw else None
    for v0 in range(0, v, chunk_vocab):
        v1 = min(v, v0 + chunk_vocab)
        wc = w[v0:v1].float()
        dwc = torch.zeros((v1 - v0, k), device=h.device, dtype=torch.float32) if need_dw else None
        for t0 in range(0, n, chunk_tokens):
            t1 = min(n, t0 + chunk_tokens)
            hc = h[t0:t1].float()
            s = (hc @ wc.T) * inv_temp
            p = torch.exp(s - lse[t0:t1, None])
            g = a[t0:t1, None] * p + d[t0:t1, None]
            if b is not None:
                g = g + b[t0:t1, None] * p * s
            li = lab[t0:t1] - v0
            hit = (li >= 0) & (li < v1 - v0)
            rows = torch.nonzero(hit).squeeze(1)
            g[rows, li[rows]] += c[t0:t1][rows]
            g = g * inv_temp
            if need_dh:
                dh[t0:t1] += g @ wc
            if need_dw:
                dwc += g.T @ hc
        if need_dw:
            dw[v0:v1] = dwc.to(w.dtype)
    return dh, dw


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with an fp32 result (cuBLAS accumulates in fp32 and writes fp32 directly)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out) if out is not None else torch.mm(a, b)
    try:
        if out is not None:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        return torch.mm(a, b, out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError, TypeError):  # no mm.dtype (CPU interpreter runs)
        r = a.float() @ b.float()
        return out.copy_(r) if out is not None else r


def _grad_gemms(dz, h, wc, dh, dw_slice):
    """dh += dz @ wc (fp32 accumulator); dw_slice = dz^T @ h (one rounding to its dtype)."""
    if dh is not None:
        if dz.dtype == torch.float32:
            dh.addmm_(dz, wc)
        else:
            try:
                torch.addmm(dh, dz, wc, out_dtype=torch.float32, out=dh)
            except (NotImplementedError, RuntimeError, TypeError):
                dh.add_(_mm_f32(dz, wc))
    if dw_slice is not None:
        if dw_slice.dtype == dz.dtype:
            torch.mm(dz.T, h, out=dw_slice)
        else:
            dw_slice.copy_(torch.mm(dz.T, h))


def _flat_view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous [rows, cols] view on the front of a flat buffer (cuBLAS writes it in place)."""
    return buf[: rows * cols].view(rows, cols)


def _slice_width(n: int, v: int, bytes_per_elt: int, workspace_mb: float) -> int:
    """Vocabulary columns per slice so that the slice buffers fit workspace_mb (multiples of 256
    when that many fit, for aligned GEMMs; at least 32)."""
    width = int(workspace_mb * 2**20) // max(1, n * bytes_per_elt)
    width = width // 256 * 256 if width >= 256 else max(32, width // 32 * 32)
    return min(width, v)


def _triton_grads(h, w, lab, lse, a, b, c, d, inv_temp, need_dh, need_dw, workspace_mb):
    from components.losses.lm_head import triton_kernels  # optional dependency: triton (CUDA or its interpreter)

    n, hd = h.shape
    v = w.shape[0]
    dh = torch.zeros((n, hd), device=h.device, dtype=torch.float32) if need_dh else None
    dw = torch.empty_like(w) if need_dw else None
    width = _slice_width(n, v, h.element_size(), workspace_mb)
    ws = torch.empty(n * width, device=h.device, dtype=h.dtype)
    for v0 in range(0, v, width):
        v1 = min(v, v0 + width)
        dz = _flat_view(ws, n, v1 - v0)
        triton_kernels.dz_slice(h, w, lab, lse, a, b, c, d, v0, v1, dz, inv_temp)
        wc = w[v0:v1] if w.dtype == h.dtype else w[v0:v1].to(h.dtype)
        _grad_gemms(dz, h, wc, dh, dw[v0:v1] if need_dw else None)
    return dh, dw


def _cublas_stats(h, w, lab, inv_temp, need_sum, need_ps, workspace_mb):
    """Forward statistics from fp32 logits slices [N, width] (cuBLAS) folded by a Triton kernel."""
    from components.losses.lm_head import triton_kernels  # optional dependency: triton (CUDA or its interpreter)

    n, v = h.shape[0], w.shape[0]
    f32 = dict(device=h.device, dtype=torch.float32)
    acc = (torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32),
           torch.empty(n, **f32) if need_sum else None, torch.empty(n, **f32) if need_ps else None)
    width = _slice_width(n, v, 4, workspace_mb)
    zbuf = torch.empty(n * width, **f32)
    for v0 in range(0, v, width):
        v1 = min(v, v0 + width)
        z = _mm_f32(h, w[v0:v1].T if w.dtype == h.dtype else w[v0:v1].to(h.dtype).T,
                    out=_flat_view(zbuf, n, v1 - v0))
        triton_kernels.slice_stats(z, lab, v0, inv_temp, acc, first=v0 == 0)
    return tuple(x[None] if x is not None else None for x in acc)


def _cublas_grads(h, w, lab, lse, a, b, c, d, inv_temp, need_dh, need_dw, workspace_mb):
    from components.losses.lm_head import triton_kernels  # optional dependency: triton (CUDA or its interpreter)

    n, hd = h.shape
    v = w.shape[0]
    dh = torch.zeros((n, hd), device=h.device, dtype=torch.float32) if need_dh else None
    dw = torch.empty_like(w) if need_dw else None
    width = _slice_width(n, v, 4 + h.element_size(), workspace_mb)
    zbuf = torch.empty(n * width, device=h.device, dtype=torch.float32)
    dzbuf = torch.empty(n * width, device=h.device, dtype=h.dtype)
    for v0 in range(0, v, width):
        v1 = min(v, v0 + width)
        wc = w[v0:v1] if w.dtype == h.dtype else w[v0:v1].to(h.dtype)
        z = _mm_f32(h, wc.T, out=_flat_view(zbuf, n, v1 - v0))
        dz = _flat_view(dzbuf, n, v1 - v0)
        triton_kernels.slice_dz(z, dz, lab, lse, a, b, c, d, v0, inv_temp)
        _grad_gemms(dz, h, wc, dh, dw[v0:v1] if need_dw else None)
    return dh, dw


def gradients(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, stats_lse: torch.Tensor,
              a: torch.Tensor, b: torch.Tensor | None, c: torch.Tensor, d: torch.Tensor, *,
              shard: Shard, ignore_index: int, inv_temp: float, need_dh: bool, need_dw: bool,
              backend: str, chunk_tokens: int, chunk_vocab: int, workspace_mb: float):
    """Backward pass: (dL/dh [N, H] in h's dtype | None, dL/dW [V_local, H] in w's dtype | None)."""
    lab = local_labels(labels, shard, ignore_index)
    a, c, d = (x.float().contiguous() for x in (a, c, d))
    b = b.float().contiguous() if b is not None else None
    lse = stats_lse.float().contiguous()
    if backend in ("triton", "mixed"):
        dh, dw = _triton_grads(h, w, lab, lse, a, b, c, d, inv_temp, need_dh, need_dw, workspace_mb)
    elif backend == "cublas":
        dh, dw = _cublas_grads(h, w, lab, lse, a, b, c, d, inv_temp, need_dh, need_dw, workspace_mb)
    else:
        dh, dw = _torch_grads(h, w, lab, lse, a, b, c, d, inv_temp, need_dh, need_dw,
                              chunk_tokens, chunk_vocab)
    if need_dh and shard.group is not None:
        dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=shard.group)
    return (dh.to(h.dtype) if need_dh else None), dw


def as_2d(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden [..., H] and weight [V, H] disagree: {tuple(hidden.shape)} vs "
                         f"{tuple(weight.shape)}")
    h = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1)
    if h.shape[0] != lab.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden rows but {lab.shape[0]} labels")
    if h.stride(-1) != 1:
        h = h.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return h, weight, lab
