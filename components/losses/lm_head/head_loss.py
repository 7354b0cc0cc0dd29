"""The trainer side of the fused LM-head losses (linear_ce and the policy objectives).

torchtitan's ``ChunkedLossWrapper`` protocol: the trainer hands the loss the model's lm_head,
the model returns hidden states instead of logits, and the loss runs its own backward and
returns a loss whose backward feeds the decoder. A fused head loss replaces the per-chunk
logits with one call ``head_loss(self, h [N, H], w [V, H], labels [B, T], global_valid_tokens)``
that never materialises [tokens, vocab].

FSDP: like ChunkedLossWrapper, the lm_head stays unsharded for the call and is resharded
after; the fused function runs *as the lm_head's forward* (its forward is swapped for the
duration of the call), so FSDP2's own hooks unshard the weight, accumulate its gradient and
reduce-scatter it exactly as for a plain lm_head call.

Classes are built on first use and cached per name.
"""

from __future__ import annotations

import contextlib
from dataclasses import field, make_dataclass
from typing import Any

import spmd_types as spmd
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import ChunkedLossWrapper, _DecoderOutputGradientBackProp

from framework import compat

_CLASSES: dict[str, type] = {}


def subclass(name: str, head_loss, fields: dict[str, Any], methods: dict[str, Any] | None = None):
    """A ChunkedLossWrapper subclass called ``name`` whose Config adds ``fields`` (name ->
    default) to the shared ones and whose loss is ``head_loss``."""
    if name not in _CLASSES:
        _CLASSES[name] = _build(name, head_loss, fields, methods or {})
    return _CLASSES[name]


def _build(name, head_loss, fields, methods):
    extra = [(k, Any, field(default_factory=lambda v=v: v) if isinstance(v, (dict, list)) else field(default=v))
             for k, v in fields.items()]
    config = make_dataclass(
        "Config", [("num_chunks", int, field(default=1)), ("backend", str, field(default="auto")),
                   ("chunk_tokens", int, field(default=4096)), ("chunk_vocab", int, field(default=16384)),
                   ("workspace_mb", float, field(default=256.0)),
                   ("logits_dtype", str, field(default="bfloat16")), ("dw_accum", str, field(default="float32")),
                   *extra],
        bases=(ChunkedLossWrapper.Config,), kw_only=True, slots=True)
    config.__qualname__ = f"{name}.Config"

    def __init__(self, config, *, compile_config=None):
        del compile_config  # the fused path is not torch.compile'd
        self.num_chunks = 1
        self.loss_fn = None
        self.lm_head = None
        self.config = config

    @contextlib.contextmanager
    def _fused_lm_head(self, labels, global_valid_tokens):
        head = self.lm_head

        def forward(h2d):
            if getattr(head, "bias", None) is not None:
                raise NotImplementedError(f"{name}: an lm_head with a bias is not supported")
            w = head.weight
            if isinstance(w, DTensor):
                raise NotImplementedError(
                    f"{name} in the trainer takes a plain (FSDP-unsharded) lm_head weight; a "
                    "tensor-parallel (vocab-sharded) head is supported by the functions' vocab_group= "
                    "argument but not wired into the trainer yet. Use tp=1.")
            return head_loss(self, h2d, w, labels, global_valid_tokens)

        with compat.module_forward(head, forward):
            yield head

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor,
                 global_valid_tokens: torch.Tensor | None = None, **loss_inputs: Any):
        del loss_inputs  # per-token extras (positions) do not change these losses
        head = self.lm_head
        assert head is not None, "set_lm_head must run before the first call"
        fsdp = isinstance(head, FSDPModule)
        requires_grad = pred.requires_grad
        local = pred.to_local() if isinstance(pred, DTensor) else pred
        lab = labels.to_local() if isinstance(labels, DTensor) else labels
        h = local.detach().reshape(-1, local.shape[-1]).requires_grad_(requires_grad)
        if fsdp:
            head.set_reshard_after_forward(False)
            head.set_reshard_after_backward(False)
            with spmd.no_typecheck():
                head.unshard()
        try:
            with spmd.local(), self._fused_lm_head(lab, global_valid_tokens) as fused:
                loss = fused(h)
                if requires_grad:
                    with spmd.no_typecheck():
                        loss.backward()
        finally:
            if fsdp:
                head.set_reshard_after_forward(True)
                head.set_reshard_after_backward(True)
                head.reshard()
        loss = loss.detach()
        if not requires_grad:
            return loss, {}
        grad = h.grad.reshape(local.shape)
        if isinstance(pred, DTensor):
            grad = DTensor.from_local(grad, device_mesh=pred.device_mesh, placements=pred.placements)
        with spmd.no_typecheck():
            out = _DecoderOutputGradientBackProp.apply(pred, grad, loss)
        return out, {}

    ns = {"Config": config, "__init__": __init__, "_fused_lm_head": _fused_lm_head, "__call__": __call__,
          "__doc__": head_loss.__doc__, **methods}
    return type(name, (ChunkedLossWrapper,), ns)
