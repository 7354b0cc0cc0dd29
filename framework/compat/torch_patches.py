"""The patches of torch's internals (torch 2.14.1): the CPU device module, the device type, context
parallelism's BlockMask sharding, and the allocator's plain segments for CUDA IPC.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

from framework.compat.originals import _keep_original


def patch_torch_cpu_module() -> None:
    """torch 2.14.1 / torchtitan 0.3.0, CPU runs only. torchtitan calls the device module of its
    device type (``torch.cpu`` here) for the device index, name and properties, memory statistics,
    the peak-memory reset, ``empty_cache`` and seeding; ``torch.cpu`` has none of these. Adds them,
    with the machine's physical memory as ``total_memory`` and no-op statistics."""
    import torch  # reason: start-up time (torch)

    cpu = torch.cpu
    if getattr(cpu, "_apiary_shims", False):
        return
    _keep_original("torch.cpu:current_device", cpu.current_device)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu.current_device = lambda: 0  # torchtitan stores it as an int index
    cpu.get_device_name = lambda *a, **k: "cpu"
    cpu.get_device_properties = lambda *a, **k: SimpleNamespace(total_memory=total, name="cpu")
    cpu.reset_peak_memory_stats = lambda *a, **k: None
    cpu.empty_cache = lambda *a, **k: None
    cpu.memory_stats = lambda *a, **k: {}
    cpu.max_memory_reserved = lambda *a, **k: 0
    cpu.manual_seed = lambda seed: torch.manual_seed(seed)
    cpu.manual_seed_all = lambda seed: torch.manual_seed(seed)
    cpu._apiary_shims = True


def report_cpu_device_type() -> None:
    """torch 2.14.1 / torchtitan 0.3.0, CPU runs only, before torchtitan is imported. torchtitan
    reads its device type at import from ``torch._utils._get_available_device_type()`` and takes
    "cuda" when that finds no accelerator; make it say "cpu"."""
    import torch._utils as tu  # reason: start-up time (torch)

    if getattr(tu._get_available_device_type, "_apiary", False):
        return
    _keep_original("torch._utils:_get_available_device_type", tu._get_available_device_type)

    def cpu_device_type():
        return "cpu"

    cpu_device_type._apiary = True
    tu._get_available_device_type = cpu_device_type


def eager_cp_block_masks() -> None:
    """torch 2.14.1, CPU runs only. Context parallelism's BlockMask sharding compiles
    ``create_block_mask`` with inductor into the module global ``_compiled_create_block_mask`` of
    ``torch.distributed.tensor.experimental._context_parallel._attention`` (~30 s per process on
    CPU); the dense-mask attention needs only the mask_mod, so set the eager builder there."""
    from torch.distributed.tensor.experimental._context_parallel import _attention  # reason: ~0.3s to import
    from torch.nn.attention.flex_attention import create_block_mask  # reason: as above

    _attention._compiled_create_block_mask = create_block_mask


def set_cp_block_mask_load_balance(enabled: bool) -> None:
    """torch 2.14.1. torch shards a BlockMask for context parallelism with its own head-tail load
    balancer unless the private ``_cp_options.enable_load_balance`` is off; torchtitan passes none.
    Set it so that masks and tokens are sharded in the same order."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options  # reason: as above

    _cp_options.enable_load_balance = bool(enabled)




@contextlib.contextmanager
def plain_cuda_segments():
    """CUDA allocations made inside are plain segments, not expandable ones (apiary's default
    ``expandable_segments:True``, framework/alloc_conf.py): CUDA IPC exports a tensor's whole
    cudaMalloc'd segment, which expandable segments do not have. Used for the buckets an in-memory
    transport shares with a colocated engine (components/transport/vllm.py). torch 2.14.1's private
    ``torch.cuda.memory._set_allocator_settings``; restores expandable segments when they were on."""
    import torch  # reason: imported when a transport allocates its buckets

    from framework import alloc_conf  # reason: compat imports no framework module at load time
    was = torch.cuda.is_available() and alloc_conf.expandable()
    if was:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        if was:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def hold_final_rate(scheduler, total: int) -> None:
    """torch 2.14.1. ``LambdaLR.get_lr`` reads the scheduler's ``lr_lambdas`` (one factor function
    per parameter group); on this scheduler (not its class) each ``f`` becomes ``f(min(step, total))``:
    past ``total`` steps the rate stays the final one (framework/train/build.py). A second call
    changes nothing."""
    if getattr(scheduler, "_apiary_held", None) is not None:
        return
    scheduler.lr_lambdas = [(lambda s, f=f: f(min(s, total))) for f in scheduler.lr_lambdas]
    scheduler._apiary_held = total


@contextlib.contextmanager
def module_forward(module, forward):
    """torch 2.14.1. ``Module.__call__`` runs ``self.forward``; for the block this module's (not its
    class's) ``forward`` is ``forward``, then the class's again (or the module's own, where it had
    one). The fused LM-head losses (components/losses/lm_head/head_loss.py) run the head's loss in
    its place, inside torchtitan's forward."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield module
    finally:
        if own is None:
            del module.__dict__["forward"]
        else:
            module.forward = own
