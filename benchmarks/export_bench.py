"""Peak host memory and time of `apiary export` at Qwen3.5-35B-A3B's width: the whole-model
conversion it did before (every parameter loaded as fp32, converted and written as one
model.safetensors) against the streamed export (a layer at a time, bf16 or fp32, in shards).

    PYTHONPATH=. python benchmarks/export_bench.py --layers 1 2 --dir /tmp/export_bench

Per ``--layers`` L it writes a run folder with the 35B-A3B flavor cut to L layers (dim 2048, 256
experts of 512, vocab 248,320: the full width; config.yaml as `train recipe=qwen35_35b_128k
model.n_layers=L` composes it) and a DCP checkpoint step-1 of random fp32 weights: the tensors live
in file-backed shared mappings, so making it needs page cache, not the 4 bytes x parameters of
anonymous memory a trained model's save holds (a seed checkpoint at this width is killed on a
24 GiB machine). It has no manifest.json, so the exports run with --unverified (the manifest's
hashing costs the old and the new export the same). Then, each in a fresh interpreter that reports
its own peak resident memory (VmHWM of /proc/self/status: this interpreter's high-water mark; Linux's
ru_maxrss would start from the forking parent's resident size): the interpreter with torch and
the family imported (the floor), the old export (reproduced from the functions it called:
``dcp.load`` of every parameter in fp32, ``qwen3_5_hf.save_hf``), and `apiary export` in bfloat16
and float32. The table gives each peak, its time and what it wrote; the last lines extrapolate both
to the 40 layers of Qwen3.5-35B-A3B: the old peak grows by 4 bytes per parameter (fitted over the
layer counts measured), the streamed one by nothing (its largest group, the embedding or the output
head or one layer, is the same at any depth).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAVOR = "35B-A3B"

_CHILD = r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
from framework import devices
devices.install()
import torch
from components.models import hf_export, qwen3_5
mode, run, out = sys.argv[1:4]
t = time.perf_counter()
if mode == "old":  # what `apiary export` ran before streaming (qwen3_5_build.export_hf then)
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf
    cfg = OmegaConf.load(f"{run}/config.yaml")
    a = qwen3_5.arch_of(cfg.model.flavor, n_layers=cfg.model.n_layers)
    config = qwen3_5.build_config(a)
    with torch.device("meta"):
        model = qwen3_5.Qwen35TextModel(config)
    sd = {k: torch.empty(p.shape, dtype=torch.float32) for k, p in model.named_parameters()}
    dcp.load(sd, checkpoint_id=f"{run}/checkpoint/step-1", no_dist=True)
    qwen3_5.save_hf(sd, a, out, config)
elif mode != "floor":
    from toolkit.cli import apiary_main
    assert apiary_main(["export", run, "--hf", out, "--unverified", "--dtype", mode]) == 0
seconds = time.perf_counter() - t
hwm = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print("RESULT " + json.dumps({"peak_bytes": hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                              "seconds": seconds}))
"""


def make_run(run: Path, layers: int) -> int:
    """A run folder of the flavor cut to ``layers`` with a random fp32 checkpoint step-1; its parameters."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    from components.models import qwen3_5
    from framework.compose import recipes

    warnings.filterwarnings("ignore")
    cfg = recipes.load("qwen35_35b_128k", [f"model.n_layers={layers}", "data.tokenizer=byte"])
    run.mkdir(parents=True)
    OmegaConf.save(cfg, run / "config.yaml")
    with torch.device("meta"):
        model = qwen3_5.Qwen35TextModel(qwen3_5.build_config(qwen3_5.arch_of(FLAVOR, n_layers=layers)))
    scratch = run / "scratch"
    scratch.mkdir()
    sd, g = {}, torch.Generator().manual_seed(0)
    for i, (k, p) in enumerate(model.named_parameters()):
        t = torch.from_file(str(scratch / f"{i}.bin"), shared=True, size=p.numel(), dtype=torch.float32)
        sd[k] = t.view(p.shape).normal_(0, 0.02, generator=g)
    dcp.save(sd, checkpoint_id=str(run / "checkpoint" / "step-1"), no_dist=True)
    n = sum(v.numel() for v in sd.values())
    del sd
    shutil.rmtree(scratch)
    return n


def child(mode: str, run: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _CHILD, mode, str(run), str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.split("RESULT ", 1)[1])
    files = sorted(out.glob("*.safetensors")) if out.is_dir() else []
    r["files"], r["bytes"] = len(files), sum(f.stat().st_size for f in files)
    shutil.rmtree(out, ignore_errors=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[1], help="layer counts to measure (full width)")
    ap.add_argument("--dir", default="/tmp/export_bench", help="where the run folders and exports go (emptied)")
    ap.add_argument("--make", nargs=2, metavar=("RUN", "LAYERS"), help=argparse.SUPPRESS)  # one run folder, then exit
    a = ap.parse_args()
    if a.make:  # in its own interpreter, so that no mapping of the checkpoint's tensors outlives it
        print(f"PARAMS {make_run(Path(a.make[0]), int(a.make[1]))}")
        return
    from components.models import qwen3_5  # torch-free: the flavor's numbers

    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows, old_peaks = [], {}
    for layers in a.layers:
        run = root / f"run{layers}"
        t = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--make", str(run), str(layers)], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"making the checkpoint failed:\n{p.stderr[-3000:]}")
        n = int(p.stdout.split("PARAMS ", 1)[1])
        print(f"{layers} layer(s): {n:,} parameters, checkpoint written in {time.perf_counter() - t:.0f} s", flush=True)
        for mode in ("floor", "old", "bfloat16", "float32"):
            r = child(mode, run, root / f"out{layers}_{mode}")
            rows.append((layers, n, mode, r))
            print(f"  {mode:<9} peak {r['peak_bytes'] / 2**30:6.2f} GiB  {r['seconds']:6.1f} s", flush=True)
            if mode == "old":
                old_peaks[layers] = (n, r["peak_bytes"])
        shutil.rmtree(run)
    print()
    print(f"{'layers':>6} {'params':>14} {'export':<22} {'peak RSS GiB':>12} {'time s':>7} {'files':>5} {'GiB written':>11}")
    names = {"floor": "(torch + family, idle)", "old": "old: whole model fp32", "bfloat16": "streamed bf16",
             "float32": "streamed fp32"}
    for layers, n, mode, r in rows:
        print(f"{layers:>6} {n:>14,} {names[mode]:<22} {r['peak_bytes'] / 2**30:>12.2f} {r['seconds']:>7.1f} "
              f"{r['files'] or '':>5} {r['bytes'] / 2**30 if r['files'] else 0:>11.2f}")
    full, _ = qwen3_5.analytic_counts(qwen3_5.FLAVORS[FLAVOR])
    (n0, p0), *rest = sorted(old_peaks.values())
    per_param = (rest[-1][1] - p0) / (rest[-1][0] - n0) if rest else 4.0
    old40 = p0 + per_param * (full - n0)
    new40 = {d: max(r["peak_bytes"] for _, _, mode, r in rows if mode == d) for d in ("bfloat16", "float32")}
    print(f"\nQwen3.5-35B-A3B (40 layers, {full:,} parameters), extrapolated: old {old40 / 2**30:,.0f} GiB "
          f"({per_param:.2f} bytes per parameter above the measured {n0:,}); streamed {new40['bfloat16'] / 2**30:.2f} "
          f"GiB in bf16, {new40['float32'] / 2**30:.2f} GiB in fp32, as measured: its peak is its largest group "
          "(the embedding or the output head, 509M parameters; a layer, 842M), which 40 layers do not change")


if __name__ == "__main__":
    main()
