"""Qwen3.5-35B-A3B width, truncated depth: apiary's text-only model with CP + EP against
torchtitan's own Qwen3.5 (vision encoder kept, no CP) on the same trainer settings.

    python benchmarks/qwen35_bench.py --gpus 4 --layers 8 --seq 65536 --steps 10

Runs (each a torchrun job of --gpus ranks; recipe qwen35_35b_128k with overrides: FSDP2,
full recompute, chunked CE, bf16, packaged byte corpus so nothing is downloaded):
  apiary_cp    apiary Qwen3.5, global sequence --seq split by CP = gpus (head-tail; fla CP for
               GatedDeltaNet, K/V all-gather for attention), EP = gpus carved from cp
  apiary_nocp  apiary Qwen3.5, CP 1, dp_shard = EP = gpus, --seq tokens per rank
  torchtitan   torchtitan.models.qwen3_5 model_registry("35B-A3B") truncated to --layers, CP 1
               (torchtitan refuses CP for Qwen3.5), dp_shard = EP = gpus, --seq tokens per rank
Prints tokens/s (all GPUs), tokens/s/GPU, two TFLOPs/GPU counts, peak memory (max reserved) and
the planner's estimate of it, medians over steps >= --skip. "model TFLOPs" = tokens/s/GPU x the
planner's model FLOPs per token (6 x active parameters, causal softmax attention on the attention
layers only, GatedDeltaNet's chunked recurrence; no recompute); "tt TFLOPs" is torchtitan's logged
count, which treats every layer as non-causal softmax attention.
Per-run metrics land in OUT/RUN/metrics.jsonl. The first steps compile flex attention and
autotune fla's kernels (minutes); give the command a generous timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("apiary_cp", "apiary_nocp", "torchtitan")


def overrides(run: str, a) -> list[str]:
    common = ["recompute=full", f"model.n_layers={a.layers}", f"training.seq_len={a.seq}", f"training.steps={a.steps}",
              "training.local_batch=1", "data.name=packaged", "data.tokenizer=byte", "checkpoint.enable=false",
              "logging.tensorboard=false", "logging.color=false", "lr.warmup_steps=2",
              f"model.flex_autotune={str(a.flex_autotune).lower()}", f"output_dir={Path(a.out) / run}"]
    if run == "apiary_cp":
        return common + [f"parallel.cp={a.gpus}", f"parallel.ep={a.gpus}", "parallel.dp_shard=1"]
    return common + ["parallel.cp=1", f"parallel.ep={a.gpus}", f"parallel.dp_shard={a.gpus}"]


def torchtitan_spec(layers: int):
    """torchtitan's own Qwen3.5 (with its vision encoder), first ``layers`` layers; text batches
    need the image/video token ids its forward looks up (none occur in byte text)."""
    import functools

    from torchtitan.models.qwen3_5 import model_registry

    from components.models import common

    spec = model_registry("35B-A3B", moe_comm_backend="standard")
    spec.model = common.set_load_balance(common.resize_layers(spec.model, layers), 1e-3)
    parallelize = spec.parallelize_fn

    def parallelize_text(model, **kwargs):
        model = parallelize(model, **kwargs)
        model.forward = functools.partial(model.forward, special_tokens={"image_id": -1, "video_id": -2})
        return model

    spec.parallelize_fn = parallelize_text
    return spec


def worker(run: str, a) -> None:
    from framework import devices

    devices.install()
    import torch

    torch.backends.cudnn.enabled = False  # the H200 image's cuDNN is older than torch 2.14's (FACTS.md)
    from torchtitan.tools.logging import init_logger

    from framework.resolve.resolver import resolve
    from framework.train.build import trainer_config
    from framework.train.run import write_run_files

    init_logger()
    r = resolve("qwen35_35b_128k", overrides(run, a))
    if int(os.environ["RANK"]) == 0:
        write_run_files(r)
    tc = trainer_config(r)
    if run == "torchtitan":
        tc.model_spec = torchtitan_spec(a.layers)
    trainer = tc.build()
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()


def planned(run: str, a) -> tuple[float, float]:
    """The planner's model FLOPs per token and torch max-reserved bytes per GPU for ``run`` on H200s."""
    from framework.plan import planner
    from framework.resolve.resolver import resolve

    p = planner.plan(resolve("qwen35_35b_128k", overrides(run, a), world_size=a.gpus), gpu="H200")
    return p.tflops_per_gpu * 1e12 / p.tokens_per_s_per_gpu, p.torch_reserved_bytes


def summary(run: str, a) -> dict | None:
    path = Path(a.out) / run / "metrics.jsonl"
    if not path.is_file():
        return None
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    steady = [x for x in recs if x["step"] >= a.skip] or recs
    med = lambda k: statistics.median(x[k] for x in steady)  # noqa: E731
    flops_per_token, plan_bytes = planned(run, a)
    return dict(run=run, steps=len(steady), tokens_per_s=med("tokens_per_s"),
                tokens_per_s_per_gpu=med("tokens_per_s_per_gpu"),
                model_tflops_per_gpu=med("tokens_per_s_per_gpu") * flops_per_token / 1e12,
                # torchtitan's count: its own key since apiary logs the planner's count as tflops_per_gpu
                tt_tflops_per_gpu=med("tflops_per_gpu_torchtitan" if "tflops_per_gpu_torchtitan" in steady[0]
                                      else "tflops_per_gpu"), flops_per_token=flops_per_token,
                peak_gib=max(x["peak_mem_bytes"] for x in steady) / 2**30, plan_gib=plan_bytes / 2**30,
                loss=steady[-1]["loss"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--layers", type=int, default=8, help="truncated depth (keeps the 3:1 pattern)")
    p.add_argument("--seq", type=int, default=65536, help="global sequence (apiary_cp) / per-rank sequence (CP 1)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=4, help="first step counted in the medians")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--no-flex-autotune", dest="flex_autotune", action="store_false",
                   help="compile flex attention without max-autotune (minutes less before step 1)")
    p.add_argument("--out", default=str(ROOT / "runs" / "qwen35_bench"))
    p.add_argument("--report", action="store_true", help="print the table from OUT's metrics; run nothing")
    p.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a)
        return 0
    failed = []
    for run in [] if a.report else a.runs.split(","):
        (Path(a.out) / run / "metrics.jsonl").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.gpus}",
               str(Path(__file__).resolve()), "--worker", run, f"--gpus={a.gpus}", f"--layers={a.layers}",
               f"--seq={a.seq}", f"--steps={a.steps}", f"--out={a.out}",
               *([] if a.flex_autotune else ["--no-flex-autotune"])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        print(f"== {run}: {' '.join(cmd)}", flush=True)
        if subprocess.call(cmd, cwd=ROOT, env=env):
            failed.append(run)
    rows = [s for s in (summary(r, a) for r in a.runs.split(",")) if s]
    print(f"\nQwen3.5-35B-A3B width, {a.layers} layers, seq {a.seq}, {a.gpus} GPUs, steps >= {a.skip}")
    print(f"{'run':<12} {'tok/s':>10} {'tok/s/GPU':>10} {'model TFLOPs':>13} {'tt TFLOPs':>10} "
          f"{'peak GiB':>9} {'plan GiB':>9} {'loss':>7}")
    for s in rows:
        print(f"{s['run']:<12} {s['tokens_per_s']:>10,.0f} {s['tokens_per_s_per_gpu']:>10,.0f} "
              f"{s['model_tflops_per_gpu']:>13.1f} {s['tt_tflops_per_gpu']:>10.1f} {s['peak_gib']:>9.1f} "
              f"{s['plan_gib']:>9.1f} {s['loss']:>7.3f}")
    (Path(a.out) / "summary.json").parent.mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "summary.json").write_text(json.dumps(rows, indent=2))
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
