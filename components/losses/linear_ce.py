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

from components.losses.ce import check_data
from components.losses.lm_head.knobs import chunk_tokens_for  # torch-free: the planner sizes chunks with it
from framework.contracts import PlanConstant, PlanFacts, PlanTerms, Term, check_choices

# the planner's constants of every loss on the fused LM-head engine (linear_ce, the policy losses);
# calibrate as `apiary plan calib.NAME=VALUE` (docs/skills/planner.md)
PLAN_CONSTANTS = {
    "linear_ce_hidden_grad_bytes": PlanConstant(4.0, "linear_ce: gradient of the lm_head input [tokens, dim] "
                                                     "(FACTS: Liger +0.36 GiB, Cut-CE +0.13 GiB at 32K tokens "
                                                     "beyond the lm_head weight gradient)."),
    "loss_time_factor": PlanConstant(
        {"linear_ce": 1.13},
        "loss layer time over its 3 GEMMs alone, by loss: linear_ce's default (4,096-token chunks, fp32 dW) "
        "measured 165.1 ms against 146.2 ms for the bare GEMMs (one H200, V=248,320, dim 2048, 32K tokens; "
        "1.11x at 8K; docs/bench_data/h200_20261127c/loss_bench_fwdgrad_sweep_32k.txt). FACTS for the others: "
        "naive 1.68x, torch chunked 1.66x, Liger/Cut-CE 1.24-1.25x."),
}

# The function and its autograd Functions live in lm_head/linear_ce_fn.py (torch, imported on first
# use); they read as this module's attributes, so `from components.losses.linear_ce import
# linear_cross_entropy` works as before while `train --help` imports no torch.
_FUNCTIONS = ("linear_cross_entropy", "auto_backend", "check_fwdgrad_options")


def __getattr__(name: str):
    if name in _FUNCTIONS:
        from components.losses.lm_head import linear_ce_fn  # reason: start-up time (torch)

        return getattr(linear_ce_fn, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    PLAN_CONSTANTS = PLAN_CONSTANTS

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
    if not (backend in CUDA_BACKENDS and ctx.for_training and ctx.components["launcher"].RUNS_HERE):
        return
    import torch  # reason: start-up time (only a local launch on a CUDA backend asks)

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"loss.backend={backend} runs CUDA kernels and this machine has no CUDA GPU; "
                         "use loss.backend=auto (the torch path here, the fastest kernels on a GPU), torch or fwdgrad")


def fused_loss_class():
    """torchtitan loss class (built on first use, then cached)."""
    from components.losses.lm_head import head_loss  # reason: start-up time (torch, torchtitan)

    return head_loss.subclass("FusedLinearCrossEntropyLoss", _linear_ce_head_loss, {
        "z_loss": 0.0, "label_smoothing": 0.0, "global_vocab_size": None})


def _linear_ce_head_loss(self, h, w, labels, global_valid_tokens):
    """sum of per-token linear cross-entropy over this rank's tokens / global valid tokens."""
    from components.losses.lm_head.linear_ce_fn import linear_cross_entropy  # reason: start-up time (torch)

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
        rows = chunk_tokens_for(int(T), opts.chunk_tokens)
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
        facts=PlanFacts(objective=objective))
