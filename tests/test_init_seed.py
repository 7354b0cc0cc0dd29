"""The model's initial weights depend on training.seed alone (framework.train.trainer._init_from_seed).

Building or parallelizing a model may draw random numbers (TransformerEngine's linears advanced
the CUDA generator before the initialization on an H200, which gave precision.backend=te other
initial weights than bf16 at the same seed). Here a build step that draws from the generator is
simulated on CPU: with apiary's trainer the initial weights are those of a clean build; with the
restore switched off they are not (so the test can fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys
import torch
from framework import devices
from framework.train import process
devices.install()
import framework.train.trainer as ft
from framework.train.build import trainer_config
from framework.resolve.resolver import resolve

out, draw, restore = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
if not restore:
    ft._init_from_seed = lambda: None
process.single_process_env()
r = resolve("debug_moe", ["training.steps=1", "checkpoint.enable=false", "logging.tensorboard=false",
                          f"output_dir={out}"])
tc = trainer_config(r)
if draw:  # a build step that draws random numbers between seeding and initialization
    inner = tc.model_spec.parallelize_fn
    def parallelize(model, **kwargs):
        torch.randn(1000)
        return inner(model, **kwargs)
    tc.model_spec.parallelize_fn = parallelize
trainer = tc.build()
sums = {n: float(p.detach().full_tensor().double().sum() if hasattr(p, "full_tensor") else p.detach().double().sum())
        for n, p in trainer.model_parts[0].named_parameters()}
print("SUMS " + json.dumps(sums))
trainer.close()
torch.distributed.destroy_process_group()
"""


def _init_sums(tmp_path: Path, name: str, draw: bool, restore: bool = True) -> dict:
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / name), "1" if draw else "0",
                        "1" if restore else "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("SUMS ")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    return json.loads(line[0][5:])


def test_initial_weights_do_not_depend_on_what_the_build_draws(tmp_path):
    clean = _init_sums(tmp_path, "clean", draw=False)
    drawn = _init_sums(tmp_path, "drawn", draw=True)
    assert drawn == clean
    unrestored = _init_sums(tmp_path, "unrestored", draw=True, restore=False)
    differ = [n for n in clean if unrestored[n] != clean[n]]
    assert "tok_embeddings.weight" in differ and len(differ) > len(clean) // 2, differ
