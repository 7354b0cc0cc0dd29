"""Where an FP8 linear's time goes: bf16 vs torchao vs TransformerEngine, forward + backward, one GPU.

    python benchmarks/fp8_linear_bench.py                       # Qwen3-30B-A3B's attention linears, 16K tokens
    python benchmarks/fp8_linear_bench.py --tokens 32768 --shapes 2048x8192 8192x2048 --out fp8_linear.txt

For each [in x out] linear and each variant (bf16 ``x @ w.T``; torchao Float8Linear with apiary's
config, tensorwise and rowwise; TE Linear under apiary's autocast, tensorwise current scaling and
blockwise, when TransformerEngine imports), the median forward + backward time over --iters runs
(CUDA events), and a torch.profiler split of one run into GEMM kernels (cuBLAS/cuBLASLt/CUTLASS
names) and everything else (amax, scale, cast/quantize, transpose). Variants are built the way
`precision=fp8` builds them (components.precision).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GEMM_MARKS = ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")


def variants(dim_in: int, dim_out: int):
    """(name, module factory) pairs that can run here."""
    out = [("bf16", lambda: torch.nn.Linear(dim_in, dim_out, bias=False, device="cuda", dtype=torch.bfloat16))]
    try:
        from torchao.float8 import convert_to_float8_training

        from components.precision.torchao_fp8 import torchao_linear_config

        for scaling in ("tensorwise", "rowwise"):
            def make(scaling=scaling):
                m = torch.nn.Sequential(torch.nn.Linear(dim_in, dim_out, bias=False, device="cuda", dtype=torch.bfloat16))
                return convert_to_float8_training(m, config=torchao_linear_config(scaling, False))
            out.append((f"torchao {scaling}", make))
    except ImportError as e:
        print(f"torchao not importable ({e}); its rows are skipped")
    try:
        import transformer_engine.pytorch as te

        from components.precision.te import fp8_autocast, make_recipe

        for scaling in ("tensorwise", "blockwise"):
            class TE(torch.nn.Module):
                def __init__(self, scaling=scaling):
                    super().__init__()
                    self.lin = te.Linear(dim_in, dim_out, bias=False, params_dtype=torch.bfloat16, device="cuda")
                    self.recipe = make_recipe(scaling)

                def forward(self, x):
                    with fp8_autocast(self.recipe):
                        return self.lin(x)
            out.append((f"te {scaling}", TE))
    except Exception as e:  # ImportError, or a core library that does not load
        print(f"TransformerEngine not importable ({type(e).__name__}: {e}); its rows are skipped")
    return out


def time_it(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def split(fn) -> tuple[float, float]:
    """(GEMM ms, other ms) of one run, from the profiler's device times."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    gemm = other = 0.0
    for e in prof.key_averages():
        t = e.self_device_time_total / 1e3
        if any(m in e.key.lower() for m in GEMM_MARKS):
            gemm += t
        else:
            other += t
    return gemm, other


def report(lines: list[str], out: str | None) -> None:
    """Print the table; write it to ``out`` too when given."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--shapes", nargs="+", default=["2048x4096", "2048x512", "4096x2048"],
                   help="IN x OUT per linear (default: Qwen3-30B-A3B's wq, wk/wv, wo)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.backends.cudnn.enabled = False
    lines = [f"{torch.cuda.get_device_name()}, {a.tokens} tokens, forward + backward, median of {a.iters}",
             f"{'shape':>12s} {'variant':>18s} {'ms':>8s} {'vs bf16':>8s} {'GEMM ms':>8s} {'other ms':>8s}"]
    for shape in a.shapes:
        dim_in, dim_out = map(int, shape.split("x"))
        x = torch.randn(a.tokens, dim_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(a.tokens, dim_out, device="cuda", dtype=torch.bfloat16)
        base = None
        for name, make in variants(dim_in, dim_out):
            m = make()

            def step(m=m):
                x.grad = None
                for q in m.parameters():
                    q.grad = None
                m(x).backward(g)

            ms = time_it(step, a.iters, a.warmup)
            base = ms if base is None else base
            gemm, other = split(step)
            lines.append(f"{shape:>12s} {name:>18s} {ms:8.3f} {base / ms:7.2f}x {gemm:8.3f} {other:8.3f}")
            del m
        torch.cuda.empty_cache()
    report(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
