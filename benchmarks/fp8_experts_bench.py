"""Where the MoE expert GEMMs' time goes: bf16 vs torchao FP8 (rowwise grouped GEMMs), eager and compiled.

    python benchmarks/fp8_experts_bench.py                      # Qwen3-30B-A3B's and Qwen3.5-35B-A3B's experts
    python benchmarks/fp8_experts_bench.py --shapes 2048x768x128x16384 --out fp8_experts.txt

Each shape is DIM x HIDDEN x EXPERTS x TOKENS with top-8 routing spread evenly (TOKENS x 8 /
EXPERTS rows per expert, a multiple of 16 as torchao's padding dispatcher leaves them). The module
is torchtitan's GroupedExperts (three grouped GEMMs, SwiGLU) with bf16 weights, as FSDP2 hands it to
the layer; the FP8 variant is the class `precision=fp8` swaps in (torchtitan's
Float8GroupedExperts, torchao's dynamic rowwise FP8 grouped GEMMs); "compiled" wraps the module in
torch.compile as `precision.compile=true` compiles each block. Per variant: the median forward +
backward time over --iters runs (CUDA events) and a torch.profiler split of one run into grouped-GEMM
kernels and everything else (amax, scales, casts, transposes) (fp8_linear_bench's helpers).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from fp8_linear_bench import report, split, time_it  # noqa: E402

TOP_K = 8


def build(dim: int, hidden: int, experts: int, fp8: bool):
    from torchtitan.models.common.moe import GroupedExperts

    cfg = GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts)
    if fp8:
        from torchtitan.components.quantization.float8 import _get_float8_grouped_experts_cls

        cls = _get_float8_grouped_experts_cls(GroupedExperts)
        cfg = cls.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    with torch.device("cuda"):
        m = cfg.build()
    with torch.no_grad():
        for q in m.parameters():
            q.normal_(0.0, 0.02)
    return m.to(torch.bfloat16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["2048x768x128x16384", "2048x512x256x32768"],
                    help="DIM x HIDDEN x EXPERTS x TOKENS (default: Qwen3-30B-A3B at 16K, Qwen3.5-35B-A3B at 32K)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    lines = [f"{torch.cuda.get_device_name()}, top-{TOP_K}, forward + backward, median of {a.iters}",
             f"{'shape (DxFxExT)':>22s} {'variant':>16s} {'ms':>8s} {'vs bf16':>8s} {'GEMM ms':>8s} {'other ms':>8s}"]
    for shape in a.shapes:
        dim, hidden, experts, tokens = map(int, shape.split("x"))
        rows = tokens * TOP_K
        counts = torch.full((experts,), rows // experts, dtype=torch.int64, device="cuda")
        x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
        base = None
        for name, fp8, compiled in (("bf16", False, False), ("fp8 torchao", True, False),
                                    ("bf16 compiled", False, True), ("fp8 compiled", True, True)):
            try:
                m = build(dim, hidden, experts, fp8)
                fn = torch.compile(m) if compiled else m

                def step(m=m, fn=fn):
                    x.grad = None
                    for q in m.parameters():
                        q.grad = None
                    fn(x, counts).backward(g)

                ms = time_it(step, a.iters, a.warmup)
                base = ms if base is None else base
                gemm, other = split(step)
                lines.append(f"{shape:>22s} {name:>16s} {ms:8.3f} {base / ms:7.2f}x {gemm:8.3f} {other:8.3f}")
            except Exception as e:  # one variant failing (e.g. compile) leaves the others' rows
                lines.append(f"{shape:>22s} {name:>16s} failed: {type(e).__name__}: {str(e)[:200]}")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    report(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
