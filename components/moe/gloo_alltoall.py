"""Variable-split all-to-all with autograd through ``dist.all_to_all_single``.

gloo implements uneven splits only in all_to_all_single; torchtitan's EP dispatcher goes
through a path gloo refuses ("ProcessGroupGloo::alltoall: invalid tensor size").
``install`` routes torchtitan's dispatcher here on CPU (components.models.common registers it
with framework.devices' CPU parallelize hooks); the arithmetic is the same data movement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from framework import compat


class AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
    return AllToAllSingle.apply(routed_input_ND, output_splits, input_splits, self.ep_mesh.get_group())


def combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):
    return AllToAllSingle.apply(routed_output_RD, input_splits, output_splits, self.ep_mesh.get_group())


def install() -> None:
    """gloo handles uneven EP splits only through all_to_all_single: point torchtitan's
    all-to-all dispatcher at the functions above (the patch: framework/compat/torchtitan_patches.py)."""
    compat.route_token_exchange(dispatch_token_exchange, combine_token_exchange)
