"""LM head + loss, forward + backward: time and extra peak memory per implementation.

    python benchmarks/loss_bench.py --out loss_bench.json                      # H200: H=2048, V=248,320, 8K and 32K tokens
    python benchmarks/loss_bench.py --device cpu --tokens 256 --vocab 4096 --hidden 64 --out /tmp/lb.json   # smoke (fp32)

Rows (each in its own try/except, with a per-row time limit):
  gemms      the three bare GEMMs of an LM head's fwd+bwd: h W^T, dZ W, dZ^T h (dZ given)
  ce         materialised logits (input dtype) -> fp32 cross-entropy (torchtitan's ce)
  chunked    torch chunked x8 over tokens: logits + CE + backward per chunk (torchtitan's chunked)
  linear_ce  components.losses.linear_ce.linear_cross_entropy, default backend (CUDA: "auto" =
             "fwdgrad" when its buffers fit, else the recompute path "mixed")
  linear_ce_fused  the same with backend "triton": a fused Triton kernel keeps logit tiles on chip
  logprob    components.losses.logprob.token_logprobs, backward of sum(logprobs)
  logprob_entropy  same with entropy, backward of sum(logprobs) + 0.01 * sum(entropy)
  liger      Liger-Kernel's fused linear cross-entropy (skipped with a note if not installed)
  cce        Cut Cross-Entropy (skipped with a note if not installed)
  quack      quack-kernels' chunked linear cross-entropy (its default: the scaled-exp pipeline on
             SM90 with bf16 and V % 128 == 0; skipped with a note if not installed; measured with
             quack-kernels==0.6.0 and the nvidia-cutlass-dsl==4.6.0 it pins, docs/skills/linear_ce.md)
Rows of the gradient-in-forward schedule (backend "fwdgrad", three GEMM passes; opt-in with
--rows, one row per combination of the --fwdgrad-* knobs, named with the knob values):
  linear_ce_fwdgrad  linear_cross_entropy(backend="fwdgrad")
  grpo_fused   components.losses.fused_rl.fused_policy_loss("grpo", token-level norm, kl 0)
  grpo_unfused token_logprobs (default backend: the recompute path) + rl.grpo, the baseline
Shapes: --shapes 2048x248320 3072x248320 2048x151936 (HIDDENxVOCAB) replaces --hidden/--vocab.

    # the issue-16 sweep on one GPU (rows x shapes x tokens):
    python benchmarks/loss_bench.py --shapes 2048x248320 --tokens 8192 32768 \
        --rows gemms linear_ce linear_ce_fwdgrad grpo_fused grpo_unfused --fwdgrad-chunk-tokens 1024 2048 4096
Time: median of --iters timed runs after --warmup runs (CUDA events on GPU, perf_counter on CPU).
Memory: torch.cuda.max_memory_allocated() during one fwd+bwd minus the allocation before it
(inputs and any earlier .grad freed); gradients of hidden and weight are counted. CPU: n/a.
Ratio: row time / gemms time at the same shape.
Gradient check (every cross-entropy row: ce, chunked, linear_ce*, liger, cce, quack): after timing,
one more fwd+bwd, and the relative error ||g - g_ref|| / ||g_ref|| of d(hidden) and d(weight) against an
fp32 reference (logits in fp32, summed cross-entropy, computed in chunks); a row whose error exceeds
--grad-tol (default 2e-2 in bf16, 1e-4 in fp32; 5e-2 for cce, whose default gradient filtering is a
published approximation) is reported as status "wrong" and loses its time.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROWS = ["gemms", "ce", "chunked", "linear_ce", "linear_ce_fused", "logprob", "logprob_entropy", "liger", "cce",
        "quack"]
FWDGRAD_ROWS = ["linear_ce_fwdgrad", "grpo_fused", "grpo_unfused"]


class RowTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum, frame):
        raise RowTimeout(f"row exceeded {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- implementations: each returns a callable running one fwd+bwd on (h, w, labels) ----------


def make_gemms(h, w, labels):
    n, v = h.shape[0], w.shape[0]
    dz = torch.randn(n, v, device=h.device, dtype=h.dtype) * 1e-3

    def run():
        z = h @ w.T
        dh = dz @ w
        dw = dz.T @ h
        return z, dh, dw

    return run, dz  # keep dz alive outside the memory window


def make_ce(h, w, labels):
    def run():
        logits = h @ w.T
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        loss.backward()

    return run


def make_chunked(h, w, labels, num_chunks=8):
    def run():
        dh = torch.empty_like(h)
        for hc_src, lc, dst in zip(h.detach().chunk(num_chunks), labels.chunk(num_chunks), dh.chunk(num_chunks)):
            hc = hc_src.requires_grad_(True)
            loss = F.cross_entropy((hc @ w.T).float(), lc, reduction="sum")
            loss.backward()
            dst.copy_(hc.grad)
        h.backward(dh)

    return run


def make_linear_ce(h, w, labels, backend="auto"):
    from components.losses.linear_ce import linear_cross_entropy

    def run():
        linear_cross_entropy(h, w, labels, reduction="sum", backend=backend).backward()

    return run


def make_logprob(h, w, labels, entropy=False):
    from components.losses.logprob import token_logprobs

    def run():
        lp, ent = token_logprobs(h, w, labels, with_entropy=entropy)
        loss = lp.sum() + (0.01 * ent.sum() if entropy else 0.0)
        loss.backward()

    return run


def make_liger(h, w, labels):
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def run():
        fn(w, h, labels).backward()

    return run


def make_cce(h, w, labels):
    from cut_cross_entropy import linear_cross_entropy as cce

    def run():
        cce(h, w, labels, reduction="sum").backward()

    return run


def make_quack(h, w, labels):
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    def run():
        chunked_linear_cross_entropy(h, w, labels, reduction="sum").backward()

    return run


def _grpo_batch(labels):
    g = torch.Generator(device="cpu").manual_seed(1)
    n = labels.shape[0]
    old = (-torch.rand(n, generator=g) * 3).to(labels.device)
    adv = torch.randn(n, generator=g).to(labels.device)
    mask = torch.ones(n, dtype=torch.bool, device=labels.device)
    return old, adv, mask


def make_grpo_fused(h, w, labels, knobs=None):
    from components.losses.fused_rl import fused_policy_loss
    from components.losses.lm_head import fwdgrad

    old, adv, mask = _grpo_batch(labels)
    k = dict(knobs or {})
    fwdgrad.KERNEL.update({x: k.pop(x) for x in ("block", "num_warps", "streams") if x in k})

    def run():
        loss, _ = fused_policy_loss(h, w, labels, "grpo", old, adv, mask, hparams={"eps": 0.2, "norm": "token"}, **k)
        loss.backward()

    return run


def make_grpo_unfused(h, w, labels):
    from components.losses import rl
    from components.losses.logprob import token_logprobs

    old, adv, mask = _grpo_batch(labels)

    def run():
        lp, _ = token_logprobs(h, w, labels)
        rl.grpo(lp, old, adv, mask, eps=0.2, norm="token")[0].backward()

    return run


def make_fwdgrad(h, w, labels, knobs=None):
    from components.losses.linear_ce import linear_cross_entropy
    from components.losses.lm_head import fwdgrad

    k = dict(knobs or {})
    fwdgrad.KERNEL.update({x: k.pop(x) for x in ("block", "num_warps", "streams") if x in k})

    def run():
        linear_cross_entropy(h, w, labels, reduction="sum", backend="fwdgrad", **k).backward()

    return run


MAKERS = {
    "gemms": make_gemms, "ce": make_ce, "chunked": make_chunked, "linear_ce": make_linear_ce,
    "linear_ce_fused": lambda h, w, l: make_linear_ce(h, w, l, backend="triton" if h.is_cuda else "torch"),
    "logprob": make_logprob, "logprob_entropy": lambda h, w, l: make_logprob(h, w, l, entropy=True),
    "liger": make_liger, "cce": make_cce, "quack": make_quack,
    "linear_ce_fwdgrad": make_fwdgrad, "grpo_fused": make_grpo_fused, "grpo_unfused": make_grpo_unfused,
}


def fwdgrad_knob_sets(args):
    """Every combination of the --fwdgrad-* lists: (suffix, knobs)."""
    import itertools

    out = []
    for ws, lg, dw, blk, nw, st in itertools.product(args.fwdgrad_chunk_tokens, args.fwdgrad_logits, args.fwdgrad_dw,
                                                      args.fwdgrad_block, args.fwdgrad_warps, args.fwdgrad_streams):
        knobs = {"chunk_tokens": ws, "logits_dtype": lg, "dw_accum": dw, "block": blk, "num_warps": nw,
                 "streams": st}
        out.append((f"(T={ws},z={'f32' if lg == 'float32' else 'bf16'},dw={'f32' if dw == 'float32' else 'w'},"
                    f"blk={blk},nw={nw},st={st})", knobs))
    return out


CE_ROWS = {"ce", "chunked", "linear_ce", "linear_ce_fused", "liger", "cce", "quack", "linear_ce_fwdgrad"}
# A row's own gradient tolerance where its published default is an approximation: Cut-CE's gradient
# filtering (filter_eps="auto") drops softmax entries below bf16 resolution from the backward; measured
# 2.15e-2 off the fp32 reference on an H200 at 8K and 32K tokens (every exact row: 1.7e-3 to 2.3e-3).
ROW_GRAD_TOL = {"cce": 5e-2}


def reference_grads(h, w, labels, chunk: int = 4096):
    """d(hidden), d(weight) of the summed fp32 cross-entropy of logits h w^T, in fp32, chunk by chunk
    over tokens (the baseline every cross-entropy row's gradients are checked against)."""
    w32 = w.detach().float()
    dh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    dw = torch.zeros_like(w32)
    for s in range(0, h.shape[0], chunk):
        hc = h.detach()[s:s + chunk].float()
        z = hc @ w32.T
        dz = torch.softmax(z, dim=-1)
        del z
        dz[torch.arange(hc.shape[0], device=h.device), labels[s:s + chunk]] -= 1.0
        dh[s:s + chunk] = dz @ w32
        dw.addmm_(dz.T, hc)
        del dz
    return dh, dw


def grad_error(h, w, ref) -> float:
    """The larger relative error of h.grad and w.grad against ``ref`` (inf if one is missing)."""
    errs = []
    for g, r in ((h.grad, ref[0]), (w.grad, ref[1])):
        if g is None:
            return float("inf")
        errs.append(((g.float() - r).norm() / r.norm().clamp_min(1e-30)).item())
    return max(errs)


# ---- measurement ------------------------------------------------------------------------------


class Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn) -> float:
        """Seconds for one call."""
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t


def bench_row(name, h, w, labels, args, timer: Timer, knobs=None, ref=None) -> dict:
    def zero():
        h.grad = None
        w.grad = None

    made = MAKERS[name](h, w, labels) if knobs is None else MAKERS[name](h, w, labels, knobs)
    keep = None
    if isinstance(made, tuple):
        made, keep = made
    run = made

    def step():
        zero()
        run()

    for _ in range(args.warmup):
        step()
    timer.sync()
    times = [timer.time(step) for _ in range(args.iters)]
    extra = None
    if timer.cuda:
        zero()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    err = None
    if ref is not None:
        zero()
        run()
        timer.sync()
        err = grad_error(h, w, ref)
    zero()
    del keep
    return {"time_ms": statistics.median(times) * 1e3, "times_ms": [t * 1e3 for t in times],
            "extra_peak_bytes": extra, "grad_rel_err": err}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: bfloat16 on cuda, float32 on cpu (CPU bf16 matmuls are very slow)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS + FWDGRAD_ROWS)
    p.add_argument("--shapes", nargs="+", default=None,
                   help="HIDDENxVOCAB pairs, e.g. 2048x248320 3072x248320 2048x151936 (replaces --hidden/--vocab)")
    p.add_argument("--fwdgrad-chunk-tokens", type=int, nargs="+", default=[4096],
                   help="fwdgrad rows: tokens per chunk (the [chunk, V] logits buffer)")
    p.add_argument("--fwdgrad-logits", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--fwdgrad-dw", nargs="+", default=["float32"], choices=["float32", "weight"])
    p.add_argument("--fwdgrad-block", type=int, nargs="+", default=[4096], help="row kernel columns per step")
    p.add_argument("--fwdgrad-warps", type=int, nargs="+", default=[16], help="row kernel num_warps")
    p.add_argument("--fwdgrad-streams", type=int, nargs="+", default=[1], choices=[1, 2],
                   help="2: dH/dW GEMMs of chunk i on a side stream, overlapping chunk i+1 (two logits buffers)")
    p.add_argument("--grad-tol", type=float, default=None,
                   help="largest relative gradient error of a cross-entropy row (default 2e-2 bf16, 1e-4 fp32)")
    p.add_argument("--no-grad-check", action="store_true", help="skip the fp32 reference and the gradient check")
    p.add_argument("--row-timeout", type=float, default=300.0, help="seconds per row (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device; use --device cpu for the smoke mode", file=sys.stderr)
            return 2
        torch.backends.cudnn.enabled = False
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    dtype = getattr(torch, args.dtype)
    tol = args.grad_tol if args.grad_tol is not None else (2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4)
    timer = Timer(args.device)
    env = {"torch": torch.__version__, "device": args.device,
           "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    results = []
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes] if args.shapes else [
        (args.hidden, args.vocab)]
    jobs = []
    for name in args.rows:
        if name in ("linear_ce_fwdgrad", "grpo_fused"):
            jobs += [(name + suffix, name, knobs) for suffix, knobs in fwdgrad_knob_sets(args)]
        else:
            jobs.append((name, name, None))
    for hidden, vocab in shapes:
      for n in args.tokens:  # noqa: E111
        g = torch.Generator(device="cpu").manual_seed(args.seed)
        # Scaled so that logits have unit variance.
        h = (torch.randn(n, hidden, generator=g) / math.sqrt(hidden) ** 0.5).to(args.device, dtype)
        w = (torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden) ** 0.5).to(args.device, dtype)
        labels = torch.randint(0, vocab, (n,), generator=g).to(args.device)
        h.requires_grad_(True)
        w.requires_grad_(True)
        ref = None if args.no_grad_check or not any(j[1] in CE_ROWS for j in jobs) else reference_grads(h, w, labels)
        gemm_ms = None
        for label, name, knobs in jobs:
            row = {"row": label, "tokens": n, "hidden": hidden, "vocab": vocab, "dtype": args.dtype}
            if knobs:
                row["knobs"] = knobs
            try:
                with time_limit(args.row_timeout):
                    row.update(bench_row(name, h, w, labels, args, timer, knobs, ref if name in CE_ROWS else None))
                row["status"] = "ok"
                row_tol = tol if args.grad_tol is not None else max(tol, ROW_GRAD_TOL.get(name, 0.0))
                if row.get("grad_rel_err") is not None and not row["grad_rel_err"] <= row_tol:
                    row.update(status="wrong", note=f"gradients off the fp32 reference by {row['grad_rel_err']:.2e} "
                                                    f"(tolerance {row_tol:.0e})")
            except ImportError as e:
                row.update(status="skipped", note=f"not installed: {e}")
            except RowTimeout as e:
                row.update(status="timeout", note=str(e))
            except torch.OutOfMemoryError as e:
                row.update(status="oom", note=str(e).splitlines()[0])
            except Exception as e:  # keep the other rows
                row.update(status="error", note=f"{type(e).__name__}: {e}".splitlines()[0],
                           traceback=traceback.format_exc(limit=4))
            finally:
                h.grad = None
                w.grad = None
                if args.device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            if name == "gemms" and row.get("status") == "ok":
                gemm_ms = row["time_ms"]
            if row.get("status") == "ok" and gemm_ms:
                row["ratio_to_gemms"] = row["time_ms"] / gemm_ms
            results.append(row)
        del h, w, labels, ref
    from components.losses.lm_head import fwdgrad

    env["fwdgrad_cublas_fallbacks"] = sorted(fwdgrad.FALLBACKS)  # [] = bf16-in/fp32-out GEMMs ran in place
    report = {"env": env, "args": vars(args), "results": results}
    _print_table(report)
    print("fwdgrad cuBLAS fallbacks:", env["fwdgrad_cublas_fallbacks"] or "none")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def _print_table(report) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"LM head + loss fwd+bwd ({report['env']['device_name']}, {report['args']['dtype']})")
    for col in ("H", "V", "tokens", "row", "time (ms)", "x 3 GEMMs", "extra peak (GiB)", "grad err", "status"):
        t.add_column(col)
    for r in report["results"]:
        ok = r.get("status") == "ok"
        t.add_row(str(r["hidden"]), f"{r['vocab']:,}", f"{r['tokens']:,}", r["row"],
                  f"{r['time_ms']:.2f}" if ok else "-",
                  f"{r['ratio_to_gemms']:.2f}" if ok and "ratio_to_gemms" in r else "-",
                  f"{r['extra_peak_bytes'] / 2**30:.2f}" if ok and r.get("extra_peak_bytes") is not None else "n/a",
                  f"{r['grad_rel_err']:.1e}" if r.get("grad_rel_err") is not None else "-",
                  r.get("status", "?") + (f": {r['note']}" if r.get("note") else ""))
    Console(width=200).print(t)


if __name__ == "__main__":
    sys.exit(main())
