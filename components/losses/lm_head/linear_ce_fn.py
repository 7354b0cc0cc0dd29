"""``linear_cross_entropy`` (loss=linear_ce's function; components/losses/linear_ce.py describes the
math, the gradient placement and the backends) and the two autograd Functions behind it. Imported on
first use (torch): components.losses.linear_ce re-exports ``linear_cross_entropy``, ``auto_backend``
and ``check_fwdgrad_options``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.labels import IGNORE_INDEX
from components.losses.lm_head import engine, fwdgrad


@dataclass
class _Cfg:
    ignore_index: int
    z_loss: float
    label_smoothing: float
    shard: engine.Shard
    backend: str
    chunk_tokens: int
    chunk_vocab: int
    workspace_mb: float
    logits_dtype: str = "bfloat16"
    dw_accum: str = "float32"


class _LinearCEFwdGrad(torch.autograd.Function):
    """backend "fwdgrad": loss summed over tokens, dH and dW computed in the forward (three GEMM
    passes, fwdgrad.py) and scaled by the upstream gradient in the backward."""

    @staticmethod
    def forward(ctx, h, w, labels, cfg: _Cfg, inv_temp: float, need_dh: bool, need_dw: bool):
        res = fwdgrad.run(h, w, labels, shard=cfg.shard, ignore_index=cfg.ignore_index, inv_temp=inv_temp,
                    ce=fwdgrad.CE(cfg.z_loss, cfg.label_smoothing), need_dh=need_dh, need_dw=need_dw,
                    logits_dtype=cfg.logits_dtype, dw_accum=cfg.dw_accum, chunk_tokens=cfg.chunk_tokens)
        ctx.res = res
        ctx.dtypes = (h, w) if (need_dh or need_dw) else None
        return res.loss.sum()

    @staticmethod
    def backward(ctx, g):
        res, (h, w) = ctx.res, ctx.dtypes
        ctx.res = ctx.dtypes = None  # free the stored gradients as soon as they are handed over
        dh, dw = fwdgrad.scale_grads(res, g, h, w, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dh, dw, None, None, None, None, None


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, cfg: _Cfg):
        eps = cfg.label_smoothing
        st = engine.statistics(h, w, labels, shard=cfg.shard, ignore_index=cfg.ignore_index, inv_temp=1.0,
                          need_sum=eps > 0, need_ps=False, backend=cfg.backend,
                          chunk_tokens=cfg.chunk_tokens, chunk_vocab=cfg.chunk_vocab,
                          workspace_mb=cfg.workspace_mb)
        loss = st.lse - (1.0 - eps) * st.target
        if eps > 0:
            loss = loss - (eps / cfg.shard.total) * st.sum_s
        if cfg.z_loss > 0:
            loss = loss + cfg.z_loss * st.lse * st.lse
        valid = labels != cfg.ignore_index
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(h, w, labels, st.lse)
        ctx.cfg = cfg
        return loss

    @staticmethod
    def backward(ctx, g):
        h, w, labels, lse = ctx.saved_tensors
        cfg: _Cfg = ctx.cfg
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw):
            return None, None, None, None
        g = torch.where(labels != cfg.ignore_index, g.float(), torch.zeros_like(lse))
        eps = cfg.label_smoothing
        a = g * (1.0 + 2.0 * cfg.z_loss * lse) if cfg.z_loss > 0 else g
        c = -(1.0 - eps) * g
        d = -(eps / cfg.shard.total) * g
        dh, dw = engine.gradients(h, w, labels, lse, a, None, c, d, shard=cfg.shard,
                             ignore_index=cfg.ignore_index, inv_temp=1.0, need_dh=need_dh,
                             need_dw=need_dw, backend=cfg.backend, chunk_tokens=cfg.chunk_tokens,
                             chunk_vocab=cfg.chunk_vocab, workspace_mb=cfg.workspace_mb)
        return dh, dw, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         ignore_index: int = IGNORE_INDEX, reduction: str = "sum",
                         z_loss: float = 0.0, label_smoothing: float = 0.0,
                         vocab_group=None, backend: str = "auto", chunk_tokens: int = 4096,
                         chunk_vocab: int = 16384, workspace_mb: float = 256.0,
                         logits_dtype: str = "bfloat16", dw_accum: str = "float32",
                         temperature: float = 1.0) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight^T`` against ``labels`` without [N, V] logits.

    hidden [..., H] (bf16 or fp32), weight [V_local, H], labels [...] (global ids).
    reduction: "sum" (default; divide by a global token count yourself under DP/CP), "mean"
    (over non-ignored tokens; NaN when there are none, as torch's), "none" (per token, fp32,
    0 at ignored tokens). Statistics and gradients accumulate in fp32; dH comes back in
    hidden's dtype and dW in weight's. vocab_group: process group over which the vocabulary
    rows are split (contiguous, in rank order); dH is all-reduced over it. temperature divides
    the logits (the loss is that of softmax(h W^T / temperature)).

    backend "fwdgrad" (gradient in the forward, three GEMM passes; see fwdgrad.py) takes
    ``logits_dtype`` (of its [chunk_tokens, V_local] logits buffer, "bfloat16" or "float32";
    fp32 inputs always use float32), ``dw_accum`` ("float32" or "weight": the dW accumulator's
    dtype) and ``chunk_tokens`` (tokens per chunk). It needs a scalar upstream gradient, so
    reduction="none" refuses it; "auto" picks it on CUDA when a gradient is wanted, the
    reduction is sum/mean and its buffers fit in half the free memory, else "mixed" (CPU:
    "torch").
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be sum, mean or none, got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if z_loss < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_fwdgrad_options(logits_dtype, dw_accum, prefix="")
    if backend == "fwdgrad" and reduction == "none":
        raise ValueError("backend='fwdgrad' computes dW in the forward and can only scale it by a scalar "
                         "upstream gradient; reduction='none' needs backend='auto' (or mixed/triton/cublas/torch)")
    shape = labels.shape
    h, w, lab = engine.as_2d(hidden, weight, labels)
    shard = engine.vocab_shard(w, vocab_group)
    if backend == "auto":
        backend = auto_backend(h, w, reduction, logits_dtype, dw_accum, chunk_tokens)
    cfg = _Cfg(ignore_index, float(z_loss), float(label_smoothing), shard,
               engine.check_backend(backend, h), int(chunk_tokens), int(chunk_vocab), float(workspace_mb),
               logits_dtype, dw_accum)
    inv_temp = 1.0 / float(temperature)
    if cfg.backend == "fwdgrad":
        grad_on = torch.is_grad_enabled()
        total = _LinearCEFwdGrad.apply(h, w, lab, cfg, inv_temp, grad_on and h.requires_grad,
                                       grad_on and w.requires_grad)
        if reduction == "mean":
            return total / (lab != ignore_index).sum()
        return total
    if inv_temp != 1.0:  # the recompute path scales the hidden states instead (exact: s = (h / T) W^T)
        h = h / float(temperature)
    per_token = _LinearCE.apply(h, w, lab, cfg)
    if reduction == "none":
        return per_token.reshape(shape)
    total = per_token.sum()
    if reduction == "mean":
        return total / (lab != ignore_index).sum()
    return total


def auto_backend(h: torch.Tensor, w: torch.Tensor, reduction: str, logits_dtype: str, dw_accum: str,
                 chunk_tokens: int) -> str:
    """What backend="auto" runs: "fwdgrad" (three GEMM passes) on CUDA when a gradient is wanted,
    the upstream gradient is a scalar (sum/mean) and its buffers fit in half the free memory;
    otherwise the recompute path ("mixed" on CUDA, "torch" on CPU)."""
    base = engine.auto_backend(h)
    if base != "mixed" or reduction == "none" or not torch.is_grad_enabled():
        return base
    if not (h.requires_grad or w.requires_grad):
        return base
    need = fwdgrad.estimate_bytes(h.shape[0], h.shape[1], w.shape[0], logits_dtype, dw_accum, chunk_tokens,
                            h.element_size())
    free, _ = torch.cuda.mem_get_info(h.device)
    return "fwdgrad" if need < free // 2 else base


def check_fwdgrad_options(logits_dtype: str, dw_accum: str, prefix: str = "loss.") -> None:
    if logits_dtype not in fwdgrad.LOGITS_DTYPES:
        raise ValueError(f"{prefix}logits_dtype must be one of {', '.join(fwdgrad.LOGITS_DTYPES)}, "
                         f"got {logits_dtype!r}")
    if dw_accum not in fwdgrad.DW_ACCUM:
        raise ValueError(f"{prefix}dw_accum must be one of {', '.join(fwdgrad.DW_ACCUM)}, got {dw_accum!r}")
