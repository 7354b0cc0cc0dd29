"""Static-state backends on a real-width debug MoE: peak memory and step time.

    python benchmarks/state_bench.py --nproc 2 --out state_bench.json     # 2 H200s (4 with --nproc 4)
    python benchmarks/state_bench.py --smoke --out /tmp/state_bench.json  # CPU, gloo, tiny sizes

Variants (each in its own torchrun launch, so peak memory is per variant):
  fsdp2          state=fsdp2: params, grads and Adam states sharded over all ranks (ZeRO-3-like)
  fsdp2+offload  state=fsdp2 state.offload=optimizer: Adam states, fp32 master and the update on the host
  zero1          state=zero1: params (bf16) + fp32 grads at the EP layout, fp32 master + Adam sharded (ZeRO-1)
  zero1+offload  state=zero1 state.offload=optimizer
Model (built here, torchtitan's Qwen3 MoE blocks): dim 2048, 8 layers, 64 experts top-8 of hidden
768, 32 heads / 4 KV heads of dim 128, vocab 151,936 (about 3.2B parameters, 2.4B in experts);
bf16 compute, fp32 master and reductions; full recompute; seq 4096 x local batch 1 per rank.
Layout: dp_shard = nproc, EP = nproc (the apiary table caps EP at the ranks available).
Reported per variant (rank maxima): median step time after --warmup steps, tokens/s per rank,
torch.cuda.max_memory_allocated / max_memory_reserved over the measured steps, and the static
bytes each rank holds (components.state.memory.static_bytes: params, grads, optimizer on the
device; host = offloaded). CPU: peak = max RSS, allocated n/a.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS = {
    "fsdp2": ["state=fsdp2"],
    "fsdp2+offload": ["state=fsdp2", "state.offload=optimizer"],
    "zero1": ["state=zero1"],
    "zero1+offload": ["state=zero1", "state.offload=optimizer"],
}
REAL = dict(dim=2048, layers=8, experts=64, top_k=8, moe_hidden=768, heads=32, kv_heads=4, head_dim=128,
            vocab=151936, seq=4096, local_batch=1, steps=6, warmup=3, dtype="bfloat16", recompute="full")
SMOKE = dict(dim=64, layers=2, experts=8, top_k=2, moe_hidden=64, heads=4, kv_heads=2, head_dim=16,
             vocab=320, seq=64, local_batch=2, steps=2, warmup=1, dtype="bfloat16", recompute="selective")


def bench_model(a, attn_backend: str, moe_comm_backend: str, load_balance_coeff):
    from torchtitan.models import qwen3 as tt_qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3.model import Qwen3Model

    from components.models import common

    rope = CosSinRoPE.Config(dim=a.head_dim, max_seq_len=max(4096, a.seq), theta=1_000_000.0)
    layers = tt_qwen3._build_qwen3_moe_layers(
        n_layers=a.layers, dim=a.dim, n_heads=a.heads, n_kv_heads=a.kv_heads, head_dim=a.head_dim,
        moe_hidden_dim=a.moe_hidden, num_experts=a.experts, top_k=a.top_k, attn_backend=attn_backend,
        moe_comm_backend=moe_comm_backend, rope=rope, fuse_qkv=True)
    config = Qwen3Model.Config(
        vocab_size=a.vocab, dim=a.dim, norm=tt_qwen3._qwen3_norm(a.dim),
        tok_embeddings=Embedding.Config(num_embeddings=a.vocab, embedding_dim=a.dim,
                                        param_init=tt_qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=a.dim, out_features=a.vocab, param_init=tt_qwen3._LINEAR_INIT),
        layers=layers)
    config = common.set_load_balance(config, load_balance_coeff)
    return common.use_device_attention(config)


# ---------------------------------------------------------------------------- worker (torchrun)


def worker(a) -> None:
    import logging

    import torch
    import torch.distributed as dist
    from torchtitan.tools.logging import init_logger

    import framework  # noqa: F401  (device shims before torchtitan)
    from components.state.memory import static_bytes
    from framework import devices
    from framework.resolve.context import model_kwargs
    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config

    init_logger()
    logging.getLogger().setLevel(logging.WARNING)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if not devices.has_accelerator():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    overrides = [*VARIANTS[a.variant], f"training.seq_len={a.seq}", f"training.local_batch={a.local_batch}",
                 f"training.dtype={a.dtype}", f"training.steps={a.warmup + a.steps}", f"recompute={a.recompute}",
                 "checkpoint.enable=false", "logging.tensorboard=false", "logging.color=false",
                 f"output_dir={a.run_dir}", f"launcher.nproc={world}", *a.override]
    r = resolve("debug_moe", overrides)
    tc = trainer_config(r)
    kw = model_kwargs(r.cfg)
    tc.model_spec.model = bench_model(a, kw["attn_backend"], kw["moe_comm_backend"], kw["load_balance_coeff"])
    trainer = tc.build()
    times, error = [], None
    try:
        data = trainer.batch_generator(trainer.dataloader)
        before_step = []  # peak allocation up to the optimizer step (forward + backward + clip)
        inner_step = trainer.optimizers.step

        def step_with_probe(*args, **kwargs):
            before_step.append(devices.max_allocated_bytes())
            return inner_step(*args, **kwargs)

        trainer.optimizers.step = step_with_probe
        peaks = []  # per measured step: peak allocation of the whole step
        for i in range(a.warmup + a.steps):
            devices.reset_peak_memory()  # one window per step; the table reports the worst step
            trainer.step += 1
            devices.synchronize()
            t0 = time.perf_counter()
            trainer.train_step(data)
            devices.synchronize()
            times.append(time.perf_counter() - t0)
            peaks.append(devices.max_allocated_bytes())
        static = static_bytes(trainer.model_parts, trainer.optimizers)
        n_params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
        mine = {"step_s": times[a.warmup:], "static": static,
                "max_allocated": max(peaks[a.warmup:]) if peaks[0] is not None else None,
                "max_allocated_before_step": max(before_step[a.warmup:]) if before_step[0] is not None else None,
                "peak": devices.peak_memory_bytes(), "n_params": n_params}
    except Exception as e:  # noqa: BLE001  (reported per variant, e.g. an OOM)
        error = f"{type(e).__name__}: {str(e)[:400]}"
        mine = {"error": error}
    finally:
        trainer.close()
    every = [None] * world
    dist.all_gather_object(every, mine)
    dist.destroy_process_group()
    if rank != 0:
        return
    errors = [m["error"] for m in every if "error" in m]
    if errors:
        out = {"variant": a.variant, "error": errors[0]}
    else:
        step = statistics.median(max(col) for col in zip(*(m["step_s"] for m in every)))
        out = {
            "variant": a.variant, "world": world, "layout": dict(r.layout.dims), "n_params": every[0]["n_params"],
            "step_ms": round(step * 1e3, 2),
            "step_ms_each": [round(max(col) * 1e3, 2) for col in zip(*(m["step_s"] for m in every))],
            "tokens_per_s_per_rank": round(a.seq * a.local_batch / step, 1),
            "max_allocated_bytes": max(m["max_allocated"] or 0 for m in every) or None,
            "max_allocated_before_step_bytes": max(m["max_allocated_before_step"] or 0 for m in every) or None,
            "peak_bytes": max(m["peak"] for m in every), "peak_kind": devices.peak_memory_kind(),
            "static": {k: max(m["static"][k] for m in every) for k in every[0]["static"]},
        }
        metrics = Path(a.run_dir) / "metrics.jsonl"
        if metrics.is_file():
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            out["losses"] = [round(x["loss"], 4) for x in rows]
    Path(a.result).write_text(json.dumps(out))


# ---------------------------------------------------------------------------- driver


def _size(x, unit: int) -> str:
    return "n/a" if x is None else f"{x / unit:.2f}"


def table(results: list[dict]) -> str:
    ok = [r for r in results if "error" not in r]
    small = ok and max(max(r["static"].values()) for r in ok) < 2**30
    unit, name = (2**20, "MiB") if small else (2**30, "GiB")
    head = ("variant", "step ms", "tok/s/rank", f"max alloc {name}", f"peak {name}", f"params {name}",
            f"grads {name}", f"optim {name}", f"host {name}", "loss (last)")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['variant']} | failed: {r['error'][:120]}" + " |" * (len(head) - 2))
            continue
        s = r["static"]
        lines.append(" | ".join([
            r["variant"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s_per_rank']:.0f}",
            _size(r["max_allocated_bytes"], unit), _size(r["peak_bytes"], unit), _size(s["params"], unit),
            _size(s["grads"], unit), _size(s["optimizer"], unit), _size(s["host"], unit),
            f"{r['losses'][-1]:.4f}" if r.get("losses") else "-"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=False, default="state_bench.json")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, or 2 on CPU)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per variant")
    for k, v in REAL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None)
    p.add_argument("--override", action="append", default=[], help="extra recipe override k=v (repeatable)")
    # worker side
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    base = SMOKE if a.smoke else REAL
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.worker:
        worker(a)
        return 0

    import torch

    nproc = a.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    results = []
    with tempfile.TemporaryDirectory(prefix="state_bench_") as tmp:
        for v in a.variants.split(","):
            if v not in VARIANTS:
                raise SystemExit(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
            result, run_dir = Path(tmp) / f"{v}.json", Path(tmp) / v.replace("+", "_")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   str(Path(__file__).resolve()), "--worker", "--variant", v, "--result", str(result),
                   "--run-dir", str(run_dir), *(["--smoke"] if a.smoke else [])]
            for k in REAL:
                cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
            for o in a.override:
                cmd += ["--override", o]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
                if result.is_file():
                    results.append(json.loads(result.read_text()))
                else:
                    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
                    results.append({"variant": v, "error": f"exit {proc.returncode}: " + " / ".join(tail)})
            except subprocess.TimeoutExpired:
                results.append({"variant": v, "error": f"timed out after {a.timeout:.0f} s"})
            print(f"{v}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    from framework import devices

    report = {"device": devices.device_name(), "nproc": nproc, "smoke": a.smoke,
              "model": {k: getattr(a, k) for k in REAL}, "results": results}
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(table(results))
    print(f"-> {a.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
