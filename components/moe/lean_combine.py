"""Lean MoE combine (``moe.lean_combine=true``, docs/skills/lean_combine.md): the routing scores
multiply the expert outputs with the same arithmetic as torchtitan's combine, without its fp32
copies.

torchtitan's combine scores the expert-sorted outputs as ``(out.to(float32) * scores).to(out.dtype)``
before its scatter-add. Autograd then keeps the fp32 copy of ``out`` for the score gradient, and the
forward holds two fp32 [rows, dim] tensors at once (copy and product): at 64K tokens, top-8 and dim
2048 that is 4 GiB saved per MoE layer and 8 GiB of transient buffers, the largest allocations of
the step (the ones that grow the allocator's reserve).

``score_rows`` computes the same products, row block by row block, and saves the bf16 ``out``
itself (2 GiB there) with the fp32 scores: forward ``bf16(fp32(out) * s)``, backward
``grad_out = bf16(fp32(g) * s)`` and ``grad_s = sum_d(fp32(g) * fp32(out))``, exactly the ops
autograd runs for torchtitan's expression, so forward and both gradients are bitwise equal (the
per-row sum runs the same reduction over ``dim`` for any number of rows; tests/test_lean_combine.py
pairs it with ``score_rows_reference``, torchtitan's expression, bit for bit).

Where it applies: the combine of torchtitan's local and standard all-to-all dispatchers at any EP
size (an instance-level ``combine`` installed when the model is parallelized: at EP > 1 it runs the
dispatcher's own unpermute and combine all-to-all, then scores) and the chunked EP path's scoring
(components/moe/chunked_experts.py). DeepEP and HybridEP keep their own arithmetic, and so does the
standard combine under spmd_types type checking (a debug mode).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from framework import compat

ROW_BLOCK = 32768  # rows per block: 32K x 2048 fp32 = 256 MiB of transient per op


class _ScoreRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_RD: torch.Tensor, scores_R: torch.Tensor, block: int) -> torch.Tensor:
        res = torch.empty_like(out_RD)
        s = scores_R.reshape(-1, 1)
        for i in range(0, out_RD.shape[0], block):
            res[i:i + block] = (out_RD[i:i + block].to(torch.float32) * s[i:i + block]).to(out_RD.dtype)
        ctx.save_for_backward(out_RD, scores_R)
        ctx.block = block
        return res

    @staticmethod
    def backward(ctx, g_RD: torch.Tensor):
        out_RD, scores_R = ctx.saved_tensors
        block = ctx.block
        s = scores_R.reshape(-1, 1)
        g_out = torch.empty_like(out_RD) if ctx.needs_input_grad[0] else None
        g_s = torch.empty(scores_R.shape[0], 1, dtype=torch.float32, device=scores_R.device) \
            if ctx.needs_input_grad[1] else None
        for i in range(0, out_RD.shape[0], block):
            g = g_RD[i:i + block].to(torch.float32)
            if g_out is not None:
                g_out[i:i + block] = (g * s[i:i + block]).to(out_RD.dtype)
            if g_s is not None:
                g_s[i:i + block] = (g * out_RD[i:i + block].to(torch.float32)).sum(1, keepdim=True)
        return g_out, (g_s.reshape(scores_R.shape).to(scores_R.dtype) if g_s is not None else None), None


def score_rows(out_RD: torch.Tensor, scores_R: torch.Tensor, block: int = ROW_BLOCK) -> torch.Tensor:
    """``(out_RD.to(float32) * scores_R[:, None]).to(out_RD.dtype)`` with bf16 saves and row-block
    transients (module docstring); ``scores_R`` is fp32 as torchtitan's router returns it."""
    if scores_R.dtype != torch.float32 or out_RD.dim() != 2 or scores_R.shape != out_RD.shape[:1]:
        return score_rows_reference(out_RD, scores_R)  # another layout: the plain expression
    return _ScoreRows.apply(out_RD, scores_R, int(block))


def score_rows_reference(out_RD: torch.Tensor, scores_R: torch.Tensor) -> torch.Tensor:
    """The baseline partner: torchtitan 0.3.0's scoring expression in its combine."""
    return (out_RD.to(torch.float32) * scores_R.reshape(-1, 1)).to(out_RD.dtype)


def _lean_combine(dispatcher, original):
    """``dispatcher.combine`` with the lean scoring: at EP 1 the local combine; at EP > 1 the
    dispatcher's own unpermute and combine all-to-all first (its methods, on the EP group it would
    use under either SPMD backend), then the lean scoring and the same scatter-add. Under spmd_types
    type checking (a debug mode): torchtitan's own combine."""
    import spmd_types as spmd  # reason: torchtitan's dependency, at build only
    from torchtitan.distributed.spmd_types import current_spmd_mesh, maybe_set_sparse_mesh  # reason: as above
    from torchtitan.distributed.utils import get_spmd_backend  # reason: as above
    from torchtitan.ops.scatter_add import deterministic_scatter_add  # reason: as above

    def combine(routed_output_RD, metadata, x_TD):
        mesh = getattr(dispatcher, "ep_mesh", None)
        if mesh is not None:
            typed = get_spmd_backend() == "spmd_types"
            if (typed and spmd.is_type_checking()) or not hasattr(metadata, "input_splits"):
                return original(routed_output_RD, metadata, x_TD)
            with maybe_set_sparse_mesh():
                group = current_spmd_mesh().get_group("ep") if typed else mesh.get_group()
                routed_output_RD = dispatcher._unpermute(routed_output_RD, metadata.input_shape,
                                                         metadata.permuted_indices)
                routed_output_RD = dispatcher._combine_token_exchange(routed_output_RD, group, metadata.input_splits,
                                                                      metadata.output_splits)
        scored = score_rows(routed_output_RD, metadata.topk_scores_experts_sorted_N)
        idx = metadata.token_indices_experts_sorted_N.reshape(-1, 1).expand(-1, x_TD.shape[-1])
        return deterministic_scatter_add(torch.zeros_like(x_TD), idx, scored)

    return combine


def install(model: torch.nn.Module) -> int:
    """Lean scoring on every MoE layer of ``model``; returns the dispatchers changed. torchtitan's
    local and standard all-to-all dispatchers (exactly those classes) get the instance-level
    combine; the chunked experts (components.moe.chunked_experts) score with ``score_rows``."""
    from torchtitan.models.common import token_dispatcher as td  # reason: torchtitan, at build only

    changed = 0
    for m in model.modules():
        if getattr(m, "LEAN_SCORING", None) is False:  # ChunkedRoutedExperts: its chunked path
            m.LEAN_SCORING = True
        d = getattr(m, "token_dispatcher", None)
        if type(d) in (td.LocalTokenDispatcher, td.AllToAllTokenDispatcher):
            changed += compat.replace_token_combine(d, lambda original, d=d: _lean_combine(d, original))
    return changed


def use(tc) -> None:
    """At apply time: the model the trainer builds gets the lean combine before torchtitan's
    parallelize wraps its blocks (recompute reruns the patched combine too)."""
    spec = tc.model_spec
    inner = spec.parallelize_fn

    def parallelize(model, **kwargs):
        install(model)
        return inner(model, **kwargs)

    tc.model_spec = replace(spec, parallelize_fn=parallelize)
