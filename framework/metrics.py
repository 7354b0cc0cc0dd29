"""Run outputs: metrics.jsonl (one object per logged step) and a rich console line per step,
added to torchtitan's metric loggers (TensorBoard / W&B stay torchtitan's)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor

from framework import devices, first_step, kernel_cache, publish

_console = Console(highlight=False, soft_wrap=True)


class JsonlLogger(BaseLogger):
    def __init__(self, path: str, world_size: int, total_steps: int, color: bool):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.world_size, self.total_steps, self.color = world_size, total_steps, color
        self._first = True

    def log(self, metrics: dict, step: int) -> None:
        if self._first:  # a resumed run re-trains the steps after its checkpoint: one record per step
            self._first = False
            supersede(self.path, step)
        rec = {
            "step": step,
            "loss": metrics["loss_metrics/global_avg_loss"],
            "max_loss": metrics["loss_metrics/global_max_loss"],
            "grad_norm": metrics["grad_norm"],
            "tokens_per_s": metrics["throughput(tps)"] * self.world_size,
            "tokens_per_s_per_gpu": metrics["throughput(tps)"],
            "tflops_per_gpu": metrics["tflops"],
            "step_time_s": metrics["time_metrics/end_to_end(s)"],
            "peak_mem_bytes": devices.peak_memory_bytes(),
            "peak_mem_kind": devices.peak_memory_kind(),
            "lr": next((v for k, v in metrics.items() if k.startswith("lr")), None),
            **{k: v for k, v in metrics.items() if k.startswith(("policy/", "data/", "publish/"))},
            **{k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("kernels/")},
            **{k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("health/")},  # skipped steps
            **{k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("first_step/")},
        }
        if "first_step_wall_s" in rec:
            rec["first_step_autotune_slowest"] = first_step.STATE.slowest
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        style = "bold green" if self.color else ""
        _console.print(
            f"[{style}]step {step:>5}/{self.total_steps}[/{style}]" if style else f"step {step:>5}/{self.total_steps}",
            f"loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  "
            f"{rec['tokens_per_s']:,.0f} tok/s  {rec['tflops_per_gpu']:.2f} TFLOPs/GPU  "
            f"peak {rec['peak_mem_bytes'] / 2**30:.2f} GiB  {rec['step_time_s']:.3f} s/step"
            + _autotune_note(rec),
        )
        if "first_step_wall_s" in rec:
            _console.print(first_step.describe(rec), markup=False)


SUPERSEDED_NAME = "metrics.superseded.jsonl"


def supersede(path: Path, first_step: int) -> int:
    """Move the records of ``path`` with step >= ``first_step`` (written by an earlier run of this
    directory past the checkpoint this run resumed from) to ``metrics.superseded.jsonl`` beside it,
    appended in their order; the rest stays, rewritten atomically. Returns how many moved."""
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut short by a crash: not a record of any step
            moved.append(line)
            continue
        step = rec.get("step") if isinstance(rec, dict) else None
        (moved if isinstance(step, int) and step >= first_step else keep).append(line)
    if not moved:
        return 0
    aside = path.with_name(f"{path.stem}.superseded.jsonl")  # metrics.jsonl: SUPERSEDED_NAME
    with open(aside, "a") as f:
        f.write("".join(m + "\n" for m in moved))
        f.flush()
        os.fsync(f.fileno())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)
    _console.print(f"{path.name}: {len(moved)} record(s) from step {first_step} on, written before this "
                   f"resume, moved to {aside.name}")
    return len(moved)


def _autotune_note(rec: dict) -> str:
    if not rec.get("autotuned_kernels") and not rec.get("autotune_cache_hits"):
        return ""
    return (f"  (autotuning {rec['autotune_s']:.1f} s: {rec['autotuned_kernels']} kernels tuned, "
            f"{rec['autotune_cache_hits']} from the disk cache)")


class ApiaryMetrics(MetricsProcessor):
    """torchtitan's MetricsProcessor plus metrics.jsonl and the console line (rank 0)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_path: str = "metrics.jsonl"
        total_steps: int = 0

    extra_source = None  # callable -> dict of extra scalars for each logged step (policy metrics)
    max_loss_source = None  # callable -> max loss over data parallel, replacing torchtitan's (under CP)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if self.max_loss_source is not None:  # a collective: every rank calls log
            global_max_loss = self.max_loss_source()
        if self.extra_source is not None:
            extra_metrics = {**(extra_metrics or {}), **self.extra_source()}
        extra_metrics = {**(extra_metrics or {}), **{f"kernels/{k}": v for k, v in kernel_cache.LOG.take().items()},
                         **{f"first_step/{k}": v for k, v in first_step.STATE.record().items()},
                         **{f"publish/{k}": v for k, v in publish.LOG.take().items()}}
        return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    def _build_metric_logger(self, *, config, parallel_dims, **kwargs):
        inner = super()._build_metric_logger(config=config, parallel_dims=parallel_dims, **kwargs)
        if torch.distributed.get_rank() != 0:
            return inner
        container = inner if isinstance(inner, LoggerContainer) else LoggerContainer()
        if container is not inner:
            container.add_logger(inner)
        container.add_logger(JsonlLogger(config.jsonl_path, parallel_dims.world_size, config.total_steps,
                                         not config.disable_color_printing))
        return container
