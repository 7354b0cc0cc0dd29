"""The planner next to a training run: its estimate as flat keys beside the measured peak."""

from __future__ import annotations

import json
from pathlib import Path

from framework.plan.planner.estimate import plan


def detect_gpu() -> tuple[str | None, int | None]:
    """The local GPU's kind (H100/H200 when recognised) and total memory, or (None, None)."""
    from framework import devices  # device-shim ordering: it imports torch, which the worker's shims precede

    name, total = devices.accelerator_info()
    if name is None:
        return None, None
    name = name.upper()
    kind = "H200" if "H200" in name else ("H100" if "H100" in name else None)
    return kind, total


def estimate_for_run(resolved, gpu_memory_bytes: int | None = None, calibration: dict | None = None) -> dict:
    """The planner's estimate as flat keys for metrics.jsonl (next to ``peak_mem_bytes``).

    ``plan_torch_reserved_bytes`` is the number to compare with ``torch.cuda.max_memory_reserved``
    (the measured ``peak_mem_bytes``); ``plan_total_bytes`` adds the CUDA context and NCCL.
    """
    kind, total = detect_gpu()
    p = plan(resolved, gpu_memory_bytes=gpu_memory_bytes or total, gpu=kind, calibration=calibration)
    return {
        "plan_total_bytes": p.total_bytes,
        "plan_torch_reserved_bytes": p.torch_reserved_bytes,
        "plan_gpu_memory_bytes": p.gpu_memory_bytes,
        "plan_verdict": p.verdict,
        "plan_step_time_s": round(p.step_time_s, 6),
        "plan_tflops_per_gpu": round(p.tflops_per_gpu, 3),
        "plan_gpu": p.choices["gpu"],
        "plan_memory_bytes": p.memory_bytes,
    }


def merge_into_last_record(metrics_path, extra: dict) -> bool:
    """Add ``extra``'s keys to the last JSON line of metrics.jsonl; False when there is none."""
    path = Path(metrics_path)
    if not path.is_file():
        return False
    lines = path.read_text().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return False
    rec = json.loads(lines[-1])
    rec.update(extra)
    if rec.get("peak_mem_bytes") and extra.get("plan_torch_reserved_bytes"):
        rec["plan_error_fraction"] = round(extra["plan_torch_reserved_bytes"] / rec["peak_mem_bytes"] - 1, 4)
    lines[-1] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")
    return True
