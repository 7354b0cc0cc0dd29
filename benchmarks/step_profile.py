"""Where one training step spends its time and its memory: a real run of a recipe on one GPU, with
the torch profiler around steps WARMUP+1..WARMUP+STEPS and the CUDA allocator's history over one step.

    python benchmarks/step_profile.py --out DIR [--warmup 3] [--steps 2] RECIPE [KEY=VALUE ...]
    python benchmarks/step_profile.py --out /tmp/p qwen35_35b_128k model.n_layers=4 training.seq_len=32768 \
        parallel.cp=1 parallel.ep=1 parallel.dp_shard=1 data.name=packaged data.tokenizer=byte \
        checkpoint.enable=false loss=grpo data.format=rollouts

Prints (and writes to DIR/profile.txt):
  - wall time per profiled step, GPU kernel time per step, and the gap (the GPU waiting on the host);
  - the kernels by total GPU time (top 30), grouped by name;
  - host-side operations by self CPU time, with the device-to-host syncs counted (``aten::item``,
    ``aten::nonzero``, ``cudaStreamSynchronize``, ...);
  - the allocations alive at the step's memory peak, grouped by the first frame outside torch (the
    code that asked for them), from ``torch.cuda.memory._record_memory_history``.
The run itself is the product's own (`framework.train.run.train`), so the numbers are the training step's.

--parts (CUDA) also measures, on the last warm-up step, each transformer block's parts (mixer, MoE/FFN,
norms) in forward: wall time with a device sync around each part, and the memory it leaves allocated
(what it saves for backward plus its output). Run it with recompute=none to see every part's saves;
under a recompute policy the forward of a checkpointed block frees its insides, and only the first call
of a part in the step (the forward, not a recompute) is counted.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize",
            "cudaDeviceSynchronize", "cudaMemcpy", "aten::tolist", "cudaEventSynchronize")


def _site(frames: list[dict]) -> str:
    """The first frame outside torch's own files: the code that asked for the block."""
    for fr in frames:
        f = fr.get("filename", "")
        if not f or "/torch/" in f or f.startswith("<") or "/contextlib.py" in f or "/functools.py" in f:
            continue
        short = f.split("site-packages/")[-1] if "site-packages/" in f else f.replace(str(ROOT) + "/", "")
        return f"{short}:{fr.get('line', 0)} {fr.get('name', '')}"
    return frames[0].get("name", "?") if frames else "?"


def peak_sites(snapshot: dict, top: int = 25) -> tuple[int, list[tuple[str, int, int]]]:
    """(peak bytes of the blocks allocated during the recording, [(site, bytes, blocks)] alive then)."""
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    for ev in snapshot["device_traces"][0] if snapshot.get("device_traces") else []:
        act, addr, size = ev.get("action"), ev.get("addr"), int(ev.get("size", 0))
        if act == "alloc":
            live[addr] = (size, _site(ev.get("frames", [])))
            cur += size
            if cur > peak:
                peak, peak_live = cur, dict(live)
        elif act == "free_completed" and addr in live:
            cur -= live.pop(addr)[0]
    by: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, site in peak_live.values():
        by[site][0] += size
        by[site][1] += 1
    rows = sorted(((s, b, n) for s, (b, n) in by.items()), key=lambda r: -r[1])
    return peak, rows[:top]


def segment_lines(snapshot: dict, top: int = 15) -> list[str]:
    """The caching allocator's reserve: each stream's segments (reserved, allocated now), and the
    allocations that found no free block and made the reserve grow (a new segment, or an expandable
    segment mapping more), by the first frame outside torch."""
    by_stream: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for seg in snapshot.get("segments", []):
        row = by_stream[seg.get("stream", 0)]
        row[0] += int(seg.get("total_size", 0))
        row[1] += int(seg.get("allocated_size", 0))
        row[2] += 1
    out = ["", f"{'reserve by stream (at the end of the recording)':50s} {'reserved GiB':>12s} {'allocated GiB':>13s} "
               f"{'segments':>8s}"]
    for stream, (total, alloc, n) in sorted(by_stream.items(), key=lambda kv: -kv[1][0]):
        out.append(f"{'stream ' + hex(stream):50s} {total / 2**30:12.3f} {alloc / 2**30:13.3f} {n:8d}")
    grow: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for ev in snapshot["device_traces"][0] if snapshot.get("device_traces") else []:
        if ev.get("action") in ("segment_alloc", "segment_map"):
            row = grow[_site(ev.get("frames", []))]
            row[0] += int(ev.get("size", 0))
            row[1] += 1
    out.append("")
    out.append(f"{'reserve grew at (segment_alloc / segment_map during the recording)':100s} {'GiB':>8s} {'times':>7s}")
    for site, (b, n) in sorted(grow.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"{site[:100]:100s} {b / 2**30:8.3f} {n:7d}")
    return out


def block_parts(model) -> list[tuple[str, str, object]]:
    """(block, part name, module) for each direct part of each block of ``model.layers`` (through a
    checkpoint wrapper, where one is)."""
    out = []
    for name, block in model.get_submodule("layers").named_children():
        inner = block._checkpoint_wrapped_module if hasattr(block, "_checkpoint_wrapped_module") else block
        out.extend((name, part, mod) for part, mod in inner.named_children())
    return out


def measure_parts(model, run_step, torch) -> list[dict]:
    """Run one step with hooks around every block part: forward ms and bytes left allocated."""
    rows: dict[tuple[str, str], dict] = {}
    handles = []
    for blk, part, mod in block_parts(model):
        key = (blk, part)

        def pre(m, args, key=key, kind=type(mod).__name__):
            if key not in rows:  # the forward; a later call is a recompute in backward
                torch.cuda.synchronize()
                rows[key] = {"block": key[0], "part": key[1], "kind": kind,
                             "mem0": torch.cuda.memory_allocated(), "t0": time.perf_counter()}

        def post(m, args, out, key=key):
            r = rows[key]
            if "ms" not in r:
                torch.cuda.synchronize()
                r["ms"] = (time.perf_counter() - r["t0"]) * 1e3
                r["kept_bytes"] = torch.cuda.memory_allocated() - r["mem0"]

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        run_step()
    finally:
        for h in handles:
            h.remove()
    return [r for r in rows.values() if "ms" in r]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--warmup", type=int, default=3, help="steps before the profiled ones (compile, autotune)")
    p.add_argument("--steps", type=int, default=2, help="profiled steps")
    p.add_argument("--no-memory", action="store_true", help="skip the allocator history (it slows the step)")
    p.add_argument("--memory-from-start", action="store_true",
                   help="record the allocator history from the first step (where the reserved segments grow), not "
                        "only in the last step")
    p.add_argument("--parts", action="store_true", help="time and memory of each block part (CUDA; last warm-up step)")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.out / "run", ignore_errors=True)  # this script's own run folder, from an earlier call

    import torch

    from framework.resolve.resolver import resolve
    from framework.train import run, trainer

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a.no_memory = a.no_memory or not cuda  # the allocator history is CUDA's
    if a.parts and (not cuda or a.warmup < 1):
        p.error("--parts needs a CUDA device and --warmup >= 1 (it measures the last warm-up step)")
    steps = a.warmup + a.steps + (0 if a.no_memory else 1)
    overrides = [*a.overrides, f"training.steps={steps}", f"output_dir={a.out / 'run'}",
                 "logging.tensorboard=false", "preflight.memory=warn"]
    r = resolve(a.recipe, overrides)
    lines: list[str] = []
    state: dict = {}
    orig = trainer.ApiaryTrainer.train_step

    def profiled(self, data_iterator):
        step = self.step  # torchtitan increments before calling train_step: 1-based
        if step == a.warmup + 1:
            sync()
            state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        if not a.no_memory and step == (1 if a.memory_from_start else a.warmup + a.steps + 1):
            torch.cuda.synchronize()
            state["mem_before"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
        if a.parts and step == a.warmup:
            box = {}
            state["parts"] = measure_parts(self.model_parts[0], lambda: box.setdefault("out", orig(self, data_iterator)),
                                           torch)
            out = box["out"]
        else:
            out = orig(self, data_iterator)
        if step == a.warmup + a.steps:
            sync()
            state["wall"] = (time.perf_counter() - state["t0"]) / a.steps
            state["prof"].__exit__(None, None, None)
        if not a.no_memory and step == a.warmup + a.steps + 1:
            torch.cuda.synchronize()
            state["mem_peak"] = torch.cuda.max_memory_allocated()
            state["snapshot"] = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        return out

    trainer.ApiaryTrainer.train_step = profiled
    os.environ.setdefault("WANDB_MODE", "disabled")
    run.train(r, report=False)

    prof = state["prof"]
    events = prof.key_averages()
    # device-side rows only (kernels, memcpy, memset): the CPU ops' rows carry their kernels' time too
    gpu_rows = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.self_device_time_total for e in gpu_rows)
    lines.append(f"run: {a.recipe} {' '.join(a.overrides)}")
    wall_ms, gpu_ms = state["wall"] * 1e3, kernel_us / 1e3 / a.steps
    lines.append(f"wall per step {wall_ms:9.1f} ms   GPU kernels per step {gpu_ms:9.1f} ms   "
                 f"gap (GPU idle) {wall_ms - gpu_ms:8.1f} ms")
    lines.append("")
    lines.append(f"{'kernel (top 30 by GPU time)':90s} {'ms/step':>9s} {'calls/step':>10s}")
    lines.append("(kernels only; the autograd functions that launch them, by GPU time, follow)")
    kernels = sorted((e for e in gpu_rows if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    for e in kernels[:30]:
        lines.append(f"{e.key[:90]:90s} {e.self_device_time_total / 1e3 / a.steps:9.2f} {e.count / a.steps:10.1f}")
    lines.append("")
    ranges = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA and "Function" in e.key
                     and e.device_time_total > 0), key=lambda e: -e.device_time_total)
    lines.append(f"{'autograd function (top 15 by the GPU time of its kernels)':90s} {'ms/step':>9s} {'calls/step':>10s}")
    for e in ranges[:15]:
        lines.append(f"{e.key[:90]:90s} {e.device_time_total / 1e3 / a.steps:9.2f} {e.count / a.steps:10.1f}")
    lines.append("")
    lines.append(f"{'host op (top 25 by self CPU time)':70s} {'ms/step':>9s} {'calls/step':>10s}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]:
        lines.append(f"{e.key[:70]:70s} {e.self_cpu_time_total / 1e3 / a.steps:9.2f} {e.count / a.steps:10.1f}")
    lines.append("")
    lines.append("device-to-host syncs per step: " + ", ".join(
        f"{e.key} {e.count / a.steps:.0f} ({e.cpu_time_total / 1e3 / a.steps:.1f} ms)"
        for e in events if e.key in SYNC_OPS and e.count))
    if "snapshot" in state:
        peak, rows = peak_sites(state["snapshot"])
        lines.append("")
        lines.append(f"memory: allocated before the step {state['mem_before'] / 2**30:.2f} GiB, peak "
                     f"{state['mem_peak'] / 2**30:.2f} GiB, of it allocated within the step and alive at its peak "
                     f"{peak / 2**30:.2f} GiB; reserved peak {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")
        lines.append(f"{'allocated at (alive at the step peak)':100s} {'GiB':>8s} {'blocks':>7s}")
        for site, b, n in rows:
            lines.append(f"{site[:100]:100s} {b / 2**30:8.3f} {n:7d}")
        lines.extend(segment_lines(state["snapshot"]))
    if state.get("parts"):
        lines.append("")
        lines.append(f"block parts in forward (step {a.warmup}; a device sync around each part)")
        lines.append(f"{'block':>6s} {'part':16s} {'module':28s} {'fwd ms':>8s} {'left allocated GiB':>19s}")
        for r in state["parts"]:
            lines.append(f"{r['block']:>6s} {r['part']:16s} {r['kind'][:28]:28s} {r['ms']:8.2f} "
                         f"{r['kept_bytes'] / 2**30:19.3f}")
    text = "\n".join(lines)
    print(text)
    (a.out / "profile.txt").write_text(text + "\n")
    prof.export_chrome_trace(str(a.out / "trace.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
