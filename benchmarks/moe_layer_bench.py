"""One MoE layer, forward + backward under expert parallelism: moe.chunk none vs chunk2/3/4, and
moe.comm alltoall vs deepep.

    # H200 x4 (EP=4; use --nproc_per_node 2 for EP=2), Qwen3.5-35B-A3B's MoE layer, 4K..64K tokens/rank
    torchrun --nproc_per_node 4 benchmarks/moe_layer_bench.py --out moe_layer_bench.json
    # alltoall vs DeepEP (deep_ep >= 2 built by scripts/build_deepep.sh), EP=2, 4K..64K tokens/rank
    torchrun --nproc_per_node 2 benchmarks/moe_layer_bench.py --comms alltoall deepep --policies none \
        --out moe_deepep_ep2.json
    # CPU smoke (gloo); one process gives EP=1
    torchrun --nproc_per_node 2 benchmarks/moe_layer_bench.py --device cpu --tokens 256 --dim 64 --experts 8 \
        --out /tmp/mlb.json
    (add --top-k 2 --hidden 32 --shared-hidden 32 --iters 2 for a quick one: torch's CPU bf16 grouped GEMM is slow)

The layer: torchtitan's MoE built from its config helpers with Qwen3.5-35B-A3B's shape: dim 2048,
256 experts top-8 (softmax router with renormalised top-k), expert hidden 512, a shared SwiGLU
expert of hidden 512 behind a sigmoid gate (torchtitan's SigmoidGatedFeedForward), bf16
parameters and activations (what FSDP2's mixed precision hands the layer). Each rank holds
experts/EP experts and its own --tokens tokens (batch 1); the EP all-to-all is torchtitan's
standard backend for `none` and components/moe/chunked_experts.py for chunkN. --comms deepep runs
torchtitan's deepep backend (DeepEP's ElasticBuffer, sized once for the largest --tokens; policy
`none` only, chunking is an alltoall schedule); its buffer is NCCL symmetric memory, outside torch's
allocator, so the peak column does not include it (the planner's deepep_buffer term does).

Time: median of --iters fwd+bwd runs after --warmup runs, CUDA events on GPU (perf_counter on CPU),
then the max over ranks of each rank's median (the slowest rank sets the step); "vs base" is against the first
variant at the same tokens (alltoall `none` by default). Memory:
torch.cuda.max_memory_allocated() over one fwd+bwd minus what was allocated before it (weights,
inputs); CPU: n/a. Correctness: the first run of each variant is compared with the base variant
(max |diff| / max |base| over the output, and over the input and parameter gradients).
--recompute full wraps the layer in torchtitan's FullAC (the long-context default).
torch.backends.cudnn is disabled; NCCL_* variables are left as the machine sets them.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import traceback
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

POLICIES = ("none", "chunk2", "chunk3", "chunk4")
COMMS = ("alltoall", "deepep")  # moe.comm names -> torchtitan backends below
BACKENDS = {"alltoall": "standard", "deepep": "deepep"}
DEFAULT_TOKENS = (4096, 8192, 16384, 32768, 65536)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS), help="tokens per rank")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512, help="routed expert hidden size")
    p.add_argument("--shared-hidden", type=int, default=512, help="gated shared expert hidden size (0: none)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES),
                   help="none, chunk2, chunk3, chunk4, auto")
    p.add_argument("--comms", nargs="+", default=["alltoall"], choices=list(COMMS),
                   help="EP dispatch/combine backends (deepep: policy none only)")
    p.add_argument("--recompute", default="none", choices=["none", "full"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default=None, help="JSON report path (rank 0 writes it)")
    args = p.parse_args(argv)
    args.top_k = min(args.top_k, args.experts)
    bad = [x for x in args.policies if x not in POLICIES + ("auto",)]
    if bad:
        p.error(f"unknown policies {bad}")
    return args


def _policy(name: str):
    from components.moe import chunk

    return {"none": chunk.NoChunk, "chunk2": chunk.chunk2, "chunk3": chunk.chunk3,
            "chunk4": chunk.chunk4, "auto": chunk.AutoChunk}[name]


def variants(args) -> list[tuple[str, str]]:
    """(comm, policy) pairs in run order: every policy with alltoall, `none` with the other backends."""
    return [(c, p) for c in args.comms for p in args.policies if c == "alltoall" or p == "none"]


def moe_config(args, comm: str = "alltoall"):
    """torchtitan MoE config with Qwen3.5's MoE structure (sizes from args), dispatched by ``comm``."""
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.feed_forward import SigmoidGatedFeedForward
    from torchtitan.models.common.linear import Linear

    shared = None
    if args.shared_hidden > 0:
        ffn = make_ffn_config(dim=args.dim, hidden_dim=args.shared_hidden, w1_param_init={}, w2w3_param_init={})
        shared = SigmoidGatedFeedForward.Config(
            w1=ffn.w1, w2=ffn.w2, w3=ffn.w3,
            gate=Linear.Config(in_features=args.dim, out_features=1, param_init={}))
    return make_moe_config(
        num_experts=args.experts,
        router=make_router_config(dim=args.dim, num_experts=args.experts, gate_param_init={}, top_k=args.top_k,
                                  score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(dim=args.dim, hidden_dim=args.hidden, num_experts=args.experts,
                                                  top_k=args.top_k, param_init={}, comm_backend=BACKENDS[comm],
                                                  # DeepEP's buffer: sized once for the largest token count
                                                  num_max_tokens_per_rank=max(args.tokens)
                                                  if comm == "deepep" else None),
        shared_experts=shared,
        load_balance_coeff=1e-3,
    )


def _shard_experts(moe, rank: int, world: int, mesh) -> None:
    ex = moe.routed_experts.inner_experts
    e = ex.num_experts // world
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        full = getattr(ex, name)
        setattr(ex, name, torch.nn.Parameter(full.detach()[rank * e:(rank + 1) * e]))
    if mesh is not None:
        moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)


def build_layer(cfg, policy_name, rank, world, mesh, device, dtype, state=None):
    """Meta-build, keep this rank's experts, materialise on device; load `state` or seed-init."""
    from framework import devices

    cfg = copy.deepcopy(cfg)
    _policy(policy_name).convert(cfg)
    with torch.device("meta"):
        moe = cfg.build()
    _shard_experts(moe, rank, world, mesh)
    moe = moe.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for b in moe.buffers():
            b.zero_()
        if state is None:
            for name, p in moe.named_parameters():
                expert = name.endswith(("_EFD", "_EDF"))  # experts differ per rank, the rest is replicated
                g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{rank if expert else -1}".encode()))
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        else:
            moe.load_state_dict(state)
    for b_name in ("tokens_per_expert_E", "expert_bias_E"):  # fp32 counters, as torchtitan keeps them
        buf = getattr(moe, b_name, None)
        if buf is not None:
            setattr(moe, b_name, buf.float())
    devices.after_parallelize(moe)  # CPU: gloo-compatible all-to-all for torchtitan's dispatcher
    moe.train()
    return moe


def _rel(a, b) -> float:
    scale = b.float().abs().max().item()
    return (a.float() - b.float()).abs().max().item() / (scale if scale > 0 else 1.0)


def run(args) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.utils import set_spmd_backend

    from components.moe.auto_chunks import auto_num_chunks
    from components.moe.chunked_experts import ChunkedRoutedExperts
    from framework import devices

    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must divide by the EP size {world}")
    device = devices.bind_local_device(int(os.environ.get("LOCAL_RANK", rank)))
    if "deepep" in args.comms:  # one node: NVLink only (components/moe/comm.py DeepEP.environment)
        os.environ.setdefault("EP_DISABLE_GIN", "1")
        os.environ.setdefault("EP_REUSE_NCCL_COMM", "0")
    torch.backends.cudnn.enabled = False
    set_spmd_backend("partial_dtensor")  # dispatcher on the EP mesh's process group (no trainer mesh context)
    mesh = init_device_mesh(devices.device_type(), (world,), mesh_dim_names=("ep",)) if world > 1 else None
    dtype = getattr(torch, args.dtype)
    cfgs = {c: moe_config(args, c) for c in args.comms}
    ref = build_layer(moe_config(args), "none", rank, world, mesh, device, dtype)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    del ref

    results = []
    for T in args.tokens:
        g = torch.Generator().manual_seed(args.seed * 1000 + rank)
        x = (torch.randn(1, T, args.dim, generator=g)).to(device, dtype).requires_grad_(True)
        gy = (torch.randn(1, T, args.dim, generator=g) * 1e-2).to(device, dtype)
        reference = None
        base_ms = None
        for i, (comm, name) in enumerate(variants(args)):
            row = {"tokens": T, "comm": comm, "policy": name}
            try:
                moe = build_layer(cfgs[comm], name, rank, world, mesh, device, dtype, state)
                layer = FullAC(FullAC.Config())._wrap_block(moe) if args.recompute == "full" else moe

                def step(x=x, gy=gy, moe=moe, layer=layer):  # bound now: the loop deletes them after
                    x.grad = None
                    for p in moe.parameters():
                        p.grad = None
                    layer(x).backward(gy)

                # first run: correctness against `none`, and the peak memory window
                x.grad = None
                for p in moe.parameters():
                    p.grad = None
                gc.collect()
                devices.synchronize()
                devices.reset_peak_memory()
                before = devices.allocated_bytes()
                out = layer(x)
                out.backward(gy)
                devices.synchronize()
                peak = devices.max_allocated_bytes()
                row["peak_mem_bytes"] = None if peak is None else peak - before
                grads = {"x": x.grad.detach().clone(),
                         **{k: p.grad.detach().clone() for k, p in moe.named_parameters()}}
                out = out.detach()
                if i == 0:
                    reference = (out, grads)
                if reference is not None:
                    row["max_rel_err_out"] = _rel(out, reference[0])
                    row["max_rel_err_grad"] = max(_rel(grads[k], reference[1][k]) for k in grads)
                del out, grads
                for _ in range(args.warmup):
                    step()
                times = [devices.elapsed_ms(step) for _ in range(args.iters)]
                med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
                dist.all_reduce(med, op=dist.ReduceOp.MAX)
                row["median_ms"] = med.item()
                row["rank0_times_ms"] = times if rank == 0 else None
                chunked = moe.routed_experts
                row["chunks_used"] = chunked.last_num_chunks if isinstance(chunked, ChunkedRoutedExperts) else 1
                if i == 0:
                    base_ms = row["median_ms"]
                row["speedup_vs_none"] = (base_ms / row["median_ms"] - 1.0) if base_ms else None
                del moe, layer
            except Exception as e:  # keep going: one OOM must not lose the other rows
                row["error"] = f"{type(e).__name__}: {e}"
                if rank == 0:
                    traceback.print_exc()
            gc.collect()
            results.append(row)
        del x, gy, reference
    env = {"torch": torch.__version__, "device": args.device, "device_name": devices.device_name(),
           "ep": world, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
           "cudnn_enabled": torch.backends.cudnn.enabled}
    auto = {T: auto_num_chunks(T, ep_size=world, num_experts=args.experts, top_k=args.top_k) for T in args.tokens}
    return {"env": env, "args": vars(args), "results": results, "auto_choice": auto}


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    a, env = report["args"], report["env"]
    t = Table(title=f"MoE layer fwd+bwd, EP={env['ep']} on {env['device_name']} (dim {a['dim']}, "
                    f"{a['experts']} experts top-{a['top_k']}, hidden {a['hidden']}, shared {a['shared_hidden']}, "
                    f"{a['dtype']}, recompute {a['recompute']})")
    for col in ("tokens/rank", "comm", "policy", "chunks", "median ms", "vs base", "peak mem", "rel err out",
                "rel err grad", "auto"):
        t.add_column(col, justify="right")
    for r in report["results"]:
        if "error" in r:
            t.add_row(f"{r['tokens']:,}", r.get("comm", "alltoall"), r["policy"], "", "error", r["error"][:60], "", "", "",
                      "")
            continue
        mem = r.get("peak_mem_bytes")
        sp = r.get("speedup_vs_none")
        base = r is next(x for x in report["results"] if x["tokens"] == r["tokens"])
        t.add_row(f"{r['tokens']:,}", r.get("comm", "alltoall"), r["policy"], str(r["chunks_used"]),
                  f"{r['median_ms']:.3f}", "" if sp is None or base else f"{sp:+.1%}",
                  "n/a" if mem is None else f"{mem / 2**30:.2f} GiB",
                  f"{r.get('max_rel_err_out', float('nan')):.1e}", f"{r.get('max_rel_err_grad', float('nan')):.1e}",
                  f"chunk{report['auto_choice'][r['tokens']]}" if base else "")
    Console(width=170).print(t)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["APIARY_DEVICE"] = "cpu"
    from framework import devices

    devices.install()
    if args.device == "cuda" and not devices.has_accelerator():
        raise SystemExit("no CUDA device; use --device cpu for the smoke mode")
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        devices.bind_local_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(devices.backend())
    rank = dist.get_rank()
    try:
        report = run(args)
    finally:
        if own:
            dist.destroy_process_group()
    if rank == 0:
        print_table(report)
        report["auto_choice"] = {str(k): v for k, v in report["auto_choice"].items()}
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
