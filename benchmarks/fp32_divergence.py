"""How far two fp32 trainings drift apart when their gradient sums round differently.

Two data-parallel backends (state=fsdp2's reduce-scatter and state=zero1's all-reduce) add the
same fp32 gradients in different orders, so each gradient element differs by about one unit in
the last place (u = 2**-24 relative) every step; Adam and the next forward amplify that. This
script measures the amplification on the recipe tests/test_state.py compares: debug_moe, fp32,
seq_len 64, global batch 4, constant LR, 10 steps. Each trial trains once with every gradient
multiplied by (1 + k*u*N(0,1)) before each optimizer step (k=0 is the unperturbed reference)
and prints, per step, the largest relative loss and grad-norm difference to the reference over
the trials.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/fp32_divergence.py [trials] [k]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["training.seq_len=64", "training.local_batch=4", "training.steps=10", "lr.decay_ratio=0.0",
             "logging.tensorboard=false", "checkpoint.interval=1000", "checkpoint.keep_latest_k=0"]


def _one(out: str, seed: int, k: float) -> None:
    """Child process: one training with per-step gradient noise of k ulps (seed < 0: none)."""
    sys.path.insert(0, str(ROOT))
    import torch

    import framework  # noqa: F401
    from framework.resolve.resolver import resolve
    from framework.train import process, run
    from framework.train.build import trainer_config

    torch.set_num_threads(1)
    r = resolve("debug_moe", [*OVERRIDES, f"output_dir={out}"])
    process.single_process_env()
    run.write_run_files(r)
    trainer = trainer_config(r).build()
    gen = torch.Generator().manual_seed(seed)
    u = 2.0 ** -24

    def noise(*_):
        with torch.no_grad():
            for m in trainer.model_parts:
                for p in m.parameters():
                    if p.grad is not None:
                        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        g.mul_(1 + k * u * torch.randn(g.shape, generator=gen, dtype=torch.float64).float())

    if k > 0:
        for o in trainer.optimizers.optimizers:
            o.register_step_pre_hook(noise)
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    k = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in range(trials + 1):
            out = f"{tmp}/t{t}"
            subprocess.run([sys.executable, __file__, "--child", out, str(t), str(k if t else 0.0)],
                           env=env, check=True, capture_output=True)
            runs.append([json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()])
    ref = runs[0]
    print(f"| step | loss | max rel loss diff ({trials} trials, {k:g} ulp noise) | max rel grad-norm diff |")
    print("|---|---|---|---|")
    for i, a in enumerate(ref):
        dl = max(abs(r[i]["loss"] - a["loss"]) / abs(a["loss"]) for r in runs[1:])
        dn = max(abs(r[i]["grad_norm"] - a["grad_norm"]) / abs(a["grad_norm"]) for r in runs[1:])
        print(f"| {a['step']} | {a['loss']:.6f} | {dl:.2e} | {dn:.2e} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _one(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
