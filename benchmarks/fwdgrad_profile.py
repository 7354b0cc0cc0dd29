"""Where one linear_ce fwd+bwd spends its GPU time, kernel by kernel (torch.profiler, CUDA).

    python benchmarks/fwdgrad_profile.py --tokens 32768 --backend fwdgrad --chunk-tokens 4096
    python benchmarks/fwdgrad_profile.py --tokens 32768 --backend mixed          # the recompute path
    python benchmarks/fwdgrad_profile.py --objective grpo                       # fused GRPO instead of CE

Prints the profiler's table (sorted by CUDA time) and the total; --out writes it to a file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--backend", default="fwdgrad")
    p.add_argument("--objective", default=None, help="grpo|dapo|cispo|ppo|sft: fused_policy_loss instead of CE")
    p.add_argument("--workspace-mb", type=float, default=256.0, help="recompute backends")
    p.add_argument("--chunk-tokens", type=int, default=4096, help="fwdgrad: tokens per chunk")
    p.add_argument("--logits-dtype", default="bfloat16")
    p.add_argument("--dw-accum", default="float32")
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--warps", type=int, default=None)
    p.add_argument("--streams", type=int, default=None, choices=[1, 2])
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.backends.cudnn.enabled = False
    from components.losses.fused_rl import fused_policy_loss
    from components.losses.linear_ce import linear_cross_entropy
    from components.losses.lm_head import fwdgrad

    if a.block:
        fwdgrad.KERNEL["block"] = a.block
    if a.warps:
        fwdgrad.KERNEL["num_warps"] = a.warps
    if a.streams:
        fwdgrad.KERNEL["streams"] = a.streams
    n, hd, v = a.tokens, a.hidden, a.vocab
    h = (torch.randn(n, hd, device="cuda") / hd ** 0.25).bfloat16().requires_grad_(True)
    w = (torch.randn(v, hd, device="cuda") / hd ** 0.25).bfloat16().requires_grad_(True)
    lab = torch.randint(0, v, (n,), device="cuda")
    kn = dict(chunk_tokens=a.chunk_tokens, logits_dtype=a.logits_dtype, dw_accum=a.dw_accum)
    if a.objective:
        old = -torch.rand(n, device="cuda") * 3
        adv = torch.randn(n, device="cuda")
        mask = torch.ones(n, dtype=torch.bool, device="cuda")

        def step():
            fused_policy_loss(h, w, lab, a.objective, old, adv, mask, hparams={"norm": "token"}, **kn)[0].backward()
    else:
        extra = kn if a.backend == "fwdgrad" else {"workspace_mb": a.workspace_mb}

        def step():
            linear_cross_entropy(h, w, lab, backend=a.backend, **extra).backward()

    for _ in range(3):
        h.grad = w.grad = None
        step()
    torch.cuda.synchronize()
    h.grad = w.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows)
    total = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    txt = f"{a}\n{table}\ntotal CUDA time {total:.2f} ms; fallbacks: {sorted(fwdgrad.FALLBACKS) or 'none'}\n"
    print(txt)
    if a.out:
        Path(a.out).write_text(txt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
