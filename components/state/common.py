"""Helpers shared by the state backends (components.state.zero1, .offload)."""

from __future__ import annotations


def local(t):
    """The local shard of a DTensor, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def materialize_state(optimizers) -> None:
    """Create Adam's lazily-built state with one zero-gradient, zero-lr step (as torchtitan's
    init_optim_state does), without disturbing gradients the parameters already hold.
    DCP needs the state tensors to exist before it can save or load into them."""
    import torch

    for opt in optimizers:
        if opt.state or not any(g["params"] for g in opt.param_groups):
            continue
        saved = []
        for g in opt.param_groups:
            for p in g["params"]:
                saved.append(p.grad)
                p.grad = torch.zeros_like(p)
            g["_lr"], g["lr"] = g["lr"], (torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0)
        opt.step()
        it = iter(saved)
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = next(it)
            g["lr"] = g.pop("_lr")
