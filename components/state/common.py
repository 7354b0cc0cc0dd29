"""Helpers shared by the state backends (components.state.zero1, .offload)."""

from __future__ import annotations

import os
from contextlib import contextmanager


def local(t):
    """The local shard of a DTensor, or the tensor itself."""
    from torch.distributed.tensor import DTensor  # reason: start-up time (the state Options load without torch)

    return t.to_local() if isinstance(t, DTensor) else t


def materialize_state(optimizers) -> None:
    """Create Adam's lazily-built state with one zero-gradient, zero-lr step (as torchtitan's
    init_optim_state does), without disturbing gradients the parameters already hold.
    DCP needs the state tensors to exist before it can save or load into them."""
    import torch  # reason: start-up time (the state Options load without torch)

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


def check_threads(requested, offload: str = "optimizer") -> None:
    """ValueError unless ``state.offload_threads`` is >= 0, and left at 0 (auto) unless ``state.offload`` is
    optimizer, the one setting with a host update for the threads to run (the backends' pre-launch checks)."""
    if int(requested) < 0:
        raise ValueError(f"state.offload_threads must be >= 0 (0: auto), got {requested}")
    if int(requested) and offload != "optimizer":
        raise ValueError(
            f"state.offload_threads={requested} sets the CPU threads of the host optimizer update of "
            f"state.offload=optimizer, but this run has state.offload={offload}: "
            + ("the optimizer runs on the device" if offload == "none" else "FSDP2 itself runs the CPU offload")
            + ", so the setting would do nothing. Set state.offload=optimizer, or drop state.offload_threads.")


def host_threads(requested: int = 0) -> int:
    """CPU threads for one rank's host-side optimizer update (``state.offload_threads``).

    ``requested`` > 0 is used as given. 0 (auto): the CPUs this process may run on, split evenly
    over the ranks of its node (``LOCAL_WORLD_SIZE``). torchrun starts every worker with
    OMP_NUM_THREADS=1, which would run a multi-GB Adam update on one core.
    """
    check_threads(requested)
    if requested:
        return int(requested)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, cpus // ranks_here)


@contextmanager
def torch_threads(n: int | None):
    """Run the block with ``n`` intra-op CPU threads (None: as they are), then restore the count."""
    import torch  # reason: start-up time (the state Options load without torch)

    old = torch.get_num_threads()
    n = old if n is None else n
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != old:
            torch.set_num_threads(old)


def stage_params(ctx) -> tuple[float, float]:
    """Planner: (dense, expert) parameters of the pipeline stage in ``ctx.plan`` (the embedding on
    the first stage, the LM head on the last)."""
    s, pp, pc = ctx.plan.split, ctx.layout.pp, ctx.plan
    return s["dense_blocks"] / pp + (s["emb"] if pc.first else 0) + (s["head"] if pc.last else 0), s["experts"] / pp


def step_params(ctx) -> tuple[float, float]:
    """Planner: (dense, expert) parameters per stage that a step's gradient traffic moves."""
    s, pp = ctx.plan.split, ctx.layout.pp
    return (s["dense_blocks"] + s["emb"] + s["head"]) / pp, s["experts"] / pp
