"""What bounds an offloaded optimizer step on this host: memory bandwidth and the CPU AdamW update.

    python benchmarks/host_adam_bench.py [--threads 0] [--params 4.38e9] [--gpu-step-s 0.647] [--gib 2]

Measures, with the host update's thread count (0: this process's CPUs, as ``state.offload_threads=0``):
  - copy bandwidth: ``b.copy_(a)`` of two fp32 buffers of --gib GiB (bytes read + written per second);
  - torch's CPU AdamW (``fused=True``, the update ``state.offload=optimizer`` runs on its fp32 masters)
    over chunks of 256 MiB of fp32 masters (the overlap's ``chunk_bytes``), time per parameter;
  - the same update's memory traffic: master, gradient and the two moments read, master and moments
    written (28 bytes per parameter), as GB/s, next to the copy bandwidth;
  - the projection for --params parameters held by the rank: the host update alone, and the best an
    overlapped step can reach, max(on-GPU step, host update), as a ratio to --gpu-step-s (the on-GPU
    optimizer's step, measured separately: benchmarks/offload_bench.sh).
Prints a table (rich); --out writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from components.state.common import host_threads  # the offloaded update's own thread count


def timed(fn, iters: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def copy_bandwidth(gib: float, iters: int) -> float:
    n = int(gib * 2**30) // 4
    a = torch.randn(n)
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a), iters)
    return 2 * a.numel() * 4 / s


def adamw_seconds_per_param(params: int, chunk_bytes: int, iters: int) -> float:
    """One AdamW step over ``params`` fp32 masters in chunks, as the overlapped offload steps them."""
    per = max(1, chunk_bytes // 4)
    masters = [torch.zeros(min(per, params - i), requires_grad=True) for i in range(0, params, per)]
    for m in masters:
        m.grad = torch.randn_like(m) * 1e-3
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.1, fused=True)
    s = timed(opt.step, iters)
    return s / params


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0, help="CPU threads of the update (0: this process's CPUs)")
    p.add_argument("--params", type=float, default=4.38e9, help="parameters whose masters the rank updates")
    p.add_argument("--gpu-step-s", type=float, default=0.647, help="the on-GPU optimizer's step time (s)")
    p.add_argument("--gib", type=float, default=2.0, help="size of each copy buffer and of the AdamW sample (GiB)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.threads < 0 or a.params <= 0 or a.gpu_step_s <= 0 or a.gib <= 0 or a.iters < 1:
        p.error("--threads >= 0; --params, --gpu-step-s, --gib > 0; --iters >= 1")
    threads = host_threads(a.threads)
    torch.set_num_threads(threads)
    bw = copy_bandwidth(a.gib, a.iters)
    sample = int(a.gib * 2**30) // 4  # masters in the AdamW sample (plus grads and moments: 4x)
    spp = adamw_seconds_per_param(sample, 256 << 20, a.iters)
    adam_bw = 28 / spp
    host = spp * a.params
    best = max(a.gpu_step_s, host)
    res = {"threads": threads, "copy_GBps": bw / 1e9, "adamw_ns_per_param": spp * 1e9, "adamw_GBps": adam_bw / 1e9,
           "params": a.params, "host_update_s": host, "gpu_step_s": a.gpu_step_s, "best_overlapped_step_s": best,
           "best_ratio": best / a.gpu_step_s, "torch": torch.__version__}
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"host optimizer bound ({threads} threads, torch {torch.__version__})")
    for col in ("copy GB/s", "AdamW ns/param", "AdamW GB/s (28 B/param)", "params", "host update s",
                "on-GPU step s", "best overlapped step s", "x on-GPU step"):
        t.add_column(col, justify="right")
    t.add_row(f"{bw / 1e9:,.1f}", f"{spp * 1e9:.3f}", f"{adam_bw / 1e9:,.1f}", f"{a.params / 1e9:.2f}B",
              f"{host:.3f}", f"{a.gpu_step_s:.3f}", f"{best:.3f}", f"{best / a.gpu_step_s:.2f}x")
    Console().print(t)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
