"""benchmarks/host_adam_bench.py: the host-side bound of an offloaded optimizer step, on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_host_adam_bench_projects_the_host_update(tmp_path):
    """Its projection is its measurement times the rank's parameters, and the best overlapped step is
    the slower of the GPU step and that update; bad arguments stop with a usage error."""
    out = tmp_path / "h.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "host_adam_bench.py"), "--threads", "1", "--gib", "0.02",
           "--iters", "2", "--params", "2e9", "--gpu-step-s", "0.001", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["threads"] == 1 and r["copy_GBps"] > 0 and r["adamw_ns_per_param"] > 0
    assert abs(r["host_update_s"] - r["adamw_ns_per_param"] * 1e-9 * 2e9) < 1e-9 * r["host_update_s"] + 1e-12
    assert abs(r["adamw_GBps"] - 28 / r["adamw_ns_per_param"]) < 1e-6 * r["adamw_GBps"]
    # 2B parameters take far longer than a 1 ms GPU step on one CPU thread: the host bounds the step
    assert r["best_overlapped_step_s"] == r["host_update_s"] and r["best_ratio"] > 1
    assert "host optimizer bound" in proc.stdout
    bad = subprocess.run(cmd[:2] + ["--gib", "0"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "--gib" in bad.stderr
