"""Linear cross-entropy: LM head + cross-entropy without ever materialising [tokens, vocab]
logits. ``linear_cross_entropy(hidden [N, H], weight [V, H], labels [N])`` is the function;
``LinearCrossEntropy`` is the registry component (``loss=linear_ce``) whose torchtitan loss
takes the model's hidden states (the trainer skips the lm_head) and the lm_head weight.

Per token (valid label y, s = h @ W^T, lse = logsumexp(s), V = global vocabulary):

    loss = lse - (1 - eps) * s_y - (eps / V) * sum_v s_v + z_loss * lse^2

(eps = label_smoothing, torch's convention; z-loss as in PaLM). Tokens whose label equals
``ignore_index`` contribute 0 and get no gradient. The logit gradient is
``p * (1 + 2 z_loss lse) - (1 - eps) onehot(y) - eps / V``.

Gradient placement: two paths.

* gradient-in-forward (backend "fwdgrad", what "auto" runs on CUDA when it fits; fwdgrad.py):
  per token chunk the full-vocabulary logits row is in memory ([chunk_tokens, V] buffer), so
  lse and dz come from one row kernel and the three GEMMs (logits, dH, dW) are the only
  GEMM-sized passes; dH and dW are stored and scaled by the (scalar) upstream gradient in
  backward. It needs a scalar upstream gradient (dW = sum_t g_t dz_t h_t cannot be rescaled per
  token afterwards) and memory for a logits chunk and a dW accumulator.
* recompute-in-backward (the other backends; the baseline): the forward computes only
  per-token statistics (lse, target logit, sum of logits) in one pass over the vocabulary;
  the backward recomputes the logits slice by slice, forms dz and produces dH and dW: four
  GEMM-sized passes, any upstream gradient (``reduction="none"``, ``token_logprobs``), nothing
  computed that autograd does not ask for, only lse [N] held between the passes, and buffers
  bounded by ``workspace_mb``.
In the trainer the loss runs its backward at once (torchtitan's ChunkedLossWrapper protocol),
so the forward and the backward run back to back anyway.

Backends (``backend=``; details in lm_head/engine.py): "triton" = fused Triton kernels (the
statistics kernel keeps logit tiles on chip; the gradient kernel recomputes one vocabulary
slice's logits and writes its dz into a bounded workspace, then cuBLAS runs dH += dz W and
dW = dz^T h); "cublas" = cuBLAS writes fp32 logits of one vocabulary slice into the bounded
workspace, Triton folds/converts them; "mixed" (the CUDA default of "auto") = cublas
statistics + triton gradients, the faster recompute pair on an H200; "torch" (CPU default
and the reference) = token x vocabulary chunks in fp32; "fwdgrad" above. No backend allocates
[tokens, vocab]: the recompute CUDA ones cap their buffers at ``workspace_mb`` (default 256
MiB), fwdgrad holds [chunk_tokens, V_local]. Vocabulary sharding: pass
``vocab_group`` (weight = this rank's contiguous rows, labels global); sequence sharding needs
nothing (local tokens, ``reduction="sum"``, divide by the global valid-token count).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import torch

from components.labels import IGNORE_INDEX
from components.losses.ce import check_data
from components.losses.lm_head import engine, fwdgrad, head_loss
from framework.contracts import PlanTerms, Term, check_choices


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


# --------------------------------------------------------------------------------------------
# Registry component and its torchtitan loss
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EngineOptions:
    """The fused LM-head engine's options, shared by linear_ce and the RL objectives (loss.*)."""

    backend: Literal["auto", "torch", "triton", "cublas", "mixed", "fwdgrad"] = "auto"
    """auto (fwdgrad on CUDA when it fits, else mixed; torch on CPU) | fwdgrad | mixed | cublas | triton | torch"""
    chunk_tokens: int = 4096
    """torch and fwdgrad paths: tokens per logits chunk"""
    chunk_vocab: int = 16384
    """torch path: vocabulary columns per logits chunk"""
    workspace_mb: float = 256.0
    """recompute CUDA paths: cap on the [tokens, vocab slice] buffers"""
    logits_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """fwdgrad: dtype of its logits chunk"""
    dw_accum: Literal["float32", "weight"] = "float32"
    """fwdgrad: dtype of its dW accumulator"""

    def __post_init__(self):
        check_choices(self, "loss.")
        if self.chunk_tokens < 1 or self.chunk_vocab < 1 or self.workspace_mb <= 0:
            raise ValueError("loss.chunk_tokens, loss.chunk_vocab and loss.workspace_mb must be > 0")


class LinearCrossEntropy:
    objective_keys = ("z_loss", "label_smoothing")  # change what is optimised (apiary compare)
    NEEDS_DATA = ("text", "rollouts")

    @dataclass(kw_only=True)
    class Options(EngineOptions):
        name: str = "linear_ce"
        """registry name (loss=linear_ce)"""
        z_loss: float = 0.0
        """PaLM's z-loss coefficient on lse^2 (>= 0)"""
        label_smoothing: float = 0.0
        """torch's label smoothing, in [0, 1)"""

        def __post_init__(self):
            super().__post_init__()
            if not 0.0 <= self.label_smoothing < 1.0:
                raise ValueError(f"loss.label_smoothing must be in [0, 1), got {self.label_smoothing}")
            if self.z_loss < 0:
                raise ValueError(f"loss.z_loss must be >= 0, got {self.z_loss}")

    @staticmethod
    def check(options: "LinearCrossEntropy.Options", ctx=None) -> None:
        """Called by resolve before anything starts (ValueError: the reason)."""
        type(options).__post_init__(options)
        if ctx is not None:
            check_data(options.name, LinearCrossEntropy.NEEDS_DATA, ctx)
            check_backend_here(options.backend, ctx)

    @staticmethod
    def apply(options: "LinearCrossEntropy.Options", tc, ctx) -> None:
        o = options
        tc.loss = fused_loss_class().Config(
            z_loss=o.z_loss, label_smoothing=o.label_smoothing, backend=o.backend, chunk_tokens=o.chunk_tokens,
            chunk_vocab=o.chunk_vocab, workspace_mb=o.workspace_mb, logits_dtype=o.logits_dtype,
            dw_accum=o.dw_accum, global_vocab_size=ctx.facts.vocab_size)

    @staticmethod
    def plan_terms(opts, ctx) -> PlanTerms:
        """The fused LM head: no [tokens, vocab] logits (see ``fused_head_plan_terms``)."""
        return fused_head_plan_terms(ctx, "cross_entropy", opts)

    # apiary compare: how runs differing in this component or its options are held to each other
    # (the same cross-entropy; z_loss and label_smoothing change the objective).
    NUMERICS = {"": "dtype", "z_loss": "any", "label_smoothing": "any"}


CUDA_BACKENDS = ("triton", "cublas", "mixed")  # Triton / cuBLAS vocabulary slices: CUDA (or the Triton interpreter)


def check_backend_here(backend: str, ctx) -> None:
    """A CUDA-only head backend asked for a run on this machine without a CUDA GPU (ValueError),
    before any worker starts; a scheduler's nodes are not this machine, so only local launches."""
    if (backend in CUDA_BACKENDS and ctx.for_training and ctx.components["launcher"].RUNS_HERE
            and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"):
        raise ValueError(f"loss.backend={backend} runs CUDA kernels and this machine has no CUDA GPU; "
                         "use loss.backend=auto (the torch path here, the fastest kernels on a GPU), torch or fwdgrad")


def check_fwdgrad_options(logits_dtype: str, dw_accum: str, prefix: str = "loss.") -> None:
    if logits_dtype not in fwdgrad.LOGITS_DTYPES:
        raise ValueError(f"{prefix}logits_dtype must be one of {', '.join(fwdgrad.LOGITS_DTYPES)}, "
                         f"got {logits_dtype!r}")
    if dw_accum not in fwdgrad.DW_ACCUM:
        raise ValueError(f"{prefix}dw_accum must be one of {', '.join(fwdgrad.DW_ACCUM)}, got {dw_accum!r}")


def fused_loss_class():
    """torchtitan loss class (built on first use, then cached)."""
    return head_loss.subclass("FusedLinearCrossEntropyLoss", _linear_ce_head_loss, {
        "z_loss": 0.0, "label_smoothing": 0.0, "global_vocab_size": None})


def _linear_ce_head_loss(self, h, w, labels, global_valid_tokens):
    """sum of per-token linear cross-entropy over this rank's tokens / global valid tokens."""
    cfg = self.config
    loss = linear_cross_entropy(
        h, w, labels.reshape(-1), reduction="sum", z_loss=cfg.z_loss,
        label_smoothing=cfg.label_smoothing, backend=cfg.backend,
        chunk_tokens=cfg.chunk_tokens, chunk_vocab=cfg.chunk_vocab, workspace_mb=cfg.workspace_mb,
        logits_dtype=cfg.logits_dtype, dw_accum=cfg.dw_accum)
    return loss if global_valid_tokens is None else loss / global_valid_tokens


def fused_head_plan_terms(ctx, objective: str, opts: EngineOptions | None = None) -> PlanTerms:
    """Planner terms of every loss on the fused LM-head engine (linear_ce and the policy losses):
    the buffers of the backend the options pick, and the fp32 gradient of the LM head's input; the
    loss layer runs at ``loss_time_factor.linear_ce`` of its GEMM time.

    backend auto/fwdgrad (auto runs fwdgrad on a GPU when it fits): one [chunk_tokens, V/TP] logits
    chunk in ``logits_dtype`` and the [V/TP, dim] dW accumulator (fp32 or the weight's dtype),
    ``fwdgrad.estimate_bytes``'s terms; the recompute CUDA paths: ``workspace_mb``; torch: one
    [chunk_tokens, chunk_vocab] fp32 chunk."""
    c, T, dim = ctx.plan.constants, ctx.plan.tokens, ctx.facts.dim
    opts = opts or EngineOptions()
    cols = math.ceil(ctx.facts.vocab_size / max(1, ctx.layout.tp))
    if opts.backend in ("auto", "fwdgrad"):
        rows = fwdgrad.chunk_tokens_for(int(T), opts.chunk_tokens)
        z_bytes = 4 if opts.logits_dtype == "float32" else 2
        dw_bytes = 4 if opts.dw_accum == "float32" else 2
        buffers = [Term("loss_tile", rows * cols, z_bytes, "loss",
                        f"fwdgrad logits chunk: {rows:,} tokens x vocab/TP {cols:,} x {z_bytes} B ({opts.logits_dtype})"),
                   Term("loss_dw_accum", cols * dim, dw_bytes, "loss",
                        f"fwdgrad dW accumulator: vocab/TP {cols:,} x dim {dim} x {dw_bytes} B (dw_accum={opts.dw_accum})")]
    elif opts.backend == "torch":
        rows = min(int(T), opts.chunk_tokens)
        buffers = [Term("loss_tile", rows * min(cols, opts.chunk_vocab), 4, "loss",
                        f"torch path chunk: {rows:,} tokens x {min(cols, opts.chunk_vocab):,} columns x 4 B")]
    else:
        buffers = [Term("loss_tile", 1, opts.workspace_mb * 2**20, "loss",
                        f"{opts.backend}: loss.workspace_mb={opts.workspace_mb:g}")]
    return PlanTerms(
        memory=[*buffers,
                Term("loss_hidden_grad", T * dim, c.linear_ce_hidden_grad_bytes, "loss",
                     f"{T:,.0f} tokens x dim {dim} x {c.linear_ce_hidden_grad_bytes:g} B")],
        time_factor={"lm_head": float(c.loss_time_factor.get("linear_ce", c.loss_time_factor.get("ce", 1.65)))},
        facts={"objective": objective})
