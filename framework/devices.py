"""The device shims, and the device questions the rest of apiary asks (``has_accelerator``,
``device_type``, ``backend``, memory and timing).

torchtitan 0.3.0 assumes an accelerator: it picks "cuda" when none is present, reads
memory statistics from the device module and captures CUDA graphs by default. On a
machine without CUDA, ``install()`` points torchtitan at the CPU before it is imported,
gives ``torch.cpu`` the handful of calls torchtitan makes, and makes FSDP2's
reduce-scatter use plain sums (gloo refuses ReduceOp.PREMUL_SUM). The patches of torch's and
torchtitan's internals these shims need are framework/compat/'s.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import warnings

import torch

from framework import alloc_conf, compat

_INSTALLED = False


def has_accelerator() -> bool:
    return torch.cuda.is_available() and os.environ.get("APIARY_DEVICE", "") != "cpu"


def device_type() -> str:
    return "cuda" if has_accelerator() else "cpu"


def backend() -> str:
    """Collective backend for this device: nccl on CUDA, gloo on CPU."""
    return "nccl" if has_accelerator() else "gloo"


def flex_attention_trains() -> bool:
    """Whether flex attention runs forward and backward here (torch 2.14 has no CPU backward:
    a model family swaps in a dense-mask attention elsewhere, after ``uncompiled_block_masks``)."""
    return has_accelerator()


FLEX_COMPILE_OPTIONS: dict | None = None  # what set_flex_autotune compiled flex attention with


def set_flex_autotune(enabled: bool) -> None:
    """Compile flex attention with torchtitan's inductor options (max-autotune and coordinate
    descent tuning: fastest kernels, minutes of tuning per new shape, e.g. head dim 256 at long
    context) or, with ``enabled=False``, the same options without the two tuners (seconds to
    compile, inductor's default flex kernel configs). Process-wide: torchtitan keeps the
    compiled function on the FlexAttention class."""
    global FLEX_COMPILE_OPTIONS
    from torchtitan.models.common.attention import FlexAttention  # reason: device shims: torchtitan after install()

    options = dict(FlexAttention.inductor_configs)
    if not enabled:
        options.update(max_autotune=False, coordinate_descent_tuning=False)
    if FLEX_COMPILE_OPTIONS is None and enabled:  # torchtitan's own compiled function already has them
        FLEX_COMPILE_OPTIONS = options
        return
    if options == FLEX_COMPILE_OPTIONS:
        return
    compat.compile_flex_attention(options)
    FLEX_COMPILE_OPTIONS = options


def accelerator_info() -> tuple[str | None, int | None]:
    """(device name, total memory in bytes) of local accelerator 0, or (None, None) on CPU."""
    if not has_accelerator():
        return None, None
    props = torch.cuda.get_device_properties(0)
    return props.name, int(props.total_memory)


def peak_memory_bytes() -> int:
    """Measured peak: CUDA's max reserved bytes, or this process's max RSS on CPU."""
    if has_accelerator():
        return int(torch.cuda.max_memory_reserved())
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kib * 1024)


def apply_allocator_default() -> None:
    """A rank's allocator settings (framework.alloc_conf): the default goes into the environment for
    this process and its children, and into torch's allocator when CUDA already started here (the
    launching process's preflight may have asked the GPU's memory before this rank trains)."""
    if alloc_conf.set_default() and has_accelerator() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(alloc_conf.DEFAULT)


def allocator_counters() -> dict:
    """Peak bytes held by live tensors since the last reset and the caching allocator's retries so far
    (a retry frees cached blocks and allocates again: slow, and a sign of fragmentation near the
    limit); empty on CPU."""
    if not has_accelerator():
        return {}
    stats = torch.cuda.memory_stats()
    return {"peak_alloc_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0))}


def peak_memory_kind() -> str:
    return "cuda_max_memory_reserved" if has_accelerator() else "cpu_max_rss"


# Dense BF16 tensor-core peak per GPU (FLOP/s, without sparsity) from the vendors' data sheets,
# matched in this order against the device name (the NVL and PCIe boards before the SXM default,
# GB200 before B200).
_PEAK_BF16_FLOPS = (
    (("H200", "NVL"), 835e12), (("H200",), 989e12),
    (("H100", "PCIE"), 756e12), (("H100", "NVL"), 835e12), (("H100",), 989e12),
    (("A100",), 312e12),
    (("GB200",), 2.5e15), (("B200",), 2.25e15),
)


def peak_flops(name: str | None = None) -> float | None:
    """Dense BF16 peak FLOP/s of one device (``name``: default this process's GPU) for MFU, or None
    where no peak is known: the CPU, and GPUs outside the table (no MFU is better than one against
    a guessed peak)."""
    if name is None:
        if not has_accelerator():
            return None
        name = device_name()
    upper = name.upper()
    for needles, flops in _PEAK_BF16_FLOPS:
        if all(n in upper for n in needles):
            return flops
    return None


# Third-party warnings that say nothing about an apiary run (each an exact message at its source):
# fla warns on import that Triton has no GPU to run on; apiary's CPU path uses its torch kernels. torchtitan's
# MoE router runs under autocast to float32, which CPU autocast does not take, so torch says it disables it
# (the router then computes in float32 as it asked: nothing changes).
QUIET_WARNINGS = ("Triton is not supported on current platform",
                  "In CPU autocast, but the target dtype is not supported. Disabling autocast.")


def quiet_warnings() -> None:
    """Ignore QUIET_WARNINGS (by message; every other warning still shows)."""
    for msg in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=msg)


def uncompiled_block_masks() -> None:
    """torchtitan compiles create_block_mask; on CPU inductor spends ~30 s on it per process."""
    compat.eager_block_masks()


_CPU_PARALLELIZE_HOOKS: list = []  # component shims run after parallelize on CPU (gloo)


def on_cpu_parallelize(hook) -> None:
    """Register ``hook()`` to run once a model is parallelized on CPU (a component's gloo shim)."""
    if hook not in _CPU_PARALLELIZE_HOOKS:
        _CPU_PARALLELIZE_HOOKS.append(hook)


def after_parallelize(model: torch.nn.Module) -> torch.nn.Module:
    """Per-model fix-ups after torchtitan's parallelize_fn (CPU: sum-reduce FSDP comms)."""
    if has_accelerator():
        return model
    from torch.distributed.fsdp import FSDPModule  # reason: CPU only, ~0.4s to import

    for hook in _CPU_PARALLELIZE_HOOKS:
        hook()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # gloo has no ReduceOp.PREMUL_SUM; reduce with SUM and divide afterwards.
            module.set_force_sum_reduction_for_comms(True)
    return model


def install() -> None:
    """Apply the shims once, before torchtitan is imported."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    if has_accelerator():
        return
    if any(m.startswith("torchtitan") for m in sys.modules):
        raise RuntimeError("framework.devices.install() must run before torchtitan is imported")
    quiet_warnings()  # before torchtitan's import, which imports fla for Qwen3.5
    compat.report_cpu_device_type()
    compat.patch_torch_cpu_module()


def linear_attention_backend() -> str:
    """Kernels for linear-attention layers (the delta rule and its causal conv): fla's Triton
    kernels on CUDA, apiary's chunk-wise torch implementation elsewhere
    (a model family's linear-attention layers)."""
    return "fla" if has_accelerator() else "torch"


def prepare_context_parallel() -> None:
    """CP shims. CPU: torch's CP BlockMask sharding compiles create_block_mask with inductor
    (~30 s per process on CPU); the dense-mask attention needs only the mask_mod, so use the
    eager builder."""
    if has_accelerator():
        return
    compat.eager_cp_block_masks()


# ---- timing and memory for benchmarks (added with moe_chunk; CPU returns None where untracked) ----


def bind_local_device(local_rank: int = 0) -> torch.device:
    """This process's compute device: ``cuda:<local_rank>`` made current, or the CPU."""
    if has_accelerator():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def device_name() -> str:
    return torch.cuda.get_device_name() if has_accelerator() else "cpu"


def synchronize() -> None:
    if has_accelerator():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    """Start a new peak-allocation window (CUDA); nothing to do on CPU."""
    if has_accelerator():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def allocated_bytes() -> int | None:
    """Bytes held by live tensors now (CUDA caching allocator); None on CPU (not tracked)."""
    return int(torch.cuda.memory_allocated()) if has_accelerator() else None


def max_allocated_bytes() -> int | None:
    """Peak of allocated_bytes() since reset_peak_memory(); None on CPU."""
    return int(torch.cuda.max_memory_allocated()) if has_accelerator() else None


def elapsed_ms(fn) -> float:
    """Time of ``fn()`` in ms: CUDA events on the current stream on GPU, perf_counter on CPU."""
    if has_accelerator():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# ---- host buffers for optimizer offload (state components with offload=optimizer) ----


def host_empty(shape, dtype) -> torch.Tensor:
    """A host buffer for offloaded optimizer state: page-locked when an accelerator copies
    to and from it (so those copies can be asynchronous); plain CPU memory otherwise."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=has_accelerator())
