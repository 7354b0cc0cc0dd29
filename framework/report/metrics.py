"""Run outputs: metrics.jsonl (one object per logged step) and the console (a line per logged step
and, in a terminal, a live progress line: framework/report/progress.py), added to torchtitan's metric
loggers (TensorBoard / W&B stay torchtitan's). Every field: docs/skills/progress.md."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor

from framework import devices
from framework.report import progress
from framework.train import first_step, kernel_cache, publish

_console = Console(highlight=False, soft_wrap=True)


TORCHTITAN_TFLOPS = "tflops_torchtitan"  # torchtitan's own figure, kept beside apiary's "tflops"
TORCHTITAN_DEVICE_MEMORY = ("max_active(GiB)", "max_active(%)", "max_reserved(GiB)", "max_reserved(%)",
                            "num_alloc_retries", "num_ooms")  # torchtitan's DeviceMemoryMonitor, under memory/


def counted(metrics: dict, flops_per_token: float | None, peak_flops: float | None, quantized: bool) -> dict:
    """torchtitan's step metrics with apiary's FLOPs count: ``tflops`` = ``flops_per_token`` (the
    planner's model FLOPs per trained token: causal attention at half the full score and value
    FLOPs, an adapter's frozen GEMMs without weight gradients; framework.plan.planner.model_flops_per_token)
    x tokens/s per GPU, and ``mfu(%)`` from it against ``peak_flops`` (the device's dense BF16 peak;
    none without one or with quantized GEMMs). torchtitan's ``tflops`` (6 x parameters + full
    attention) stays as ``tflops_torchtitan``. Without a count (None), no ``tflops`` or ``mfu(%)``:
    torchtitan's alone would pass for apiary's. Records without ``tflops`` (validation) pass as they are."""
    if "tflops" not in metrics:
        return metrics
    out = {k: v for k, v in metrics.items() if k not in ("tflops", "mfu(%)")}
    out[TORCHTITAN_TFLOPS] = metrics["tflops"]
    if flops_per_token:
        flops = flops_per_token * metrics["throughput(tps)"]  # tps: tokens/s per GPU
        out["tflops"] = flops / 1e12
        if peak_flops and not quantized:
            out["mfu(%)"] = 100 * flops / peak_flops
    return out


class Counted(BaseLogger):
    """Every logger of the run (metrics.jsonl, TensorBoard, W&B) gets ``counted``'s metrics."""

    def __init__(self, inner: BaseLogger, flops_per_token: float | None, peak_flops: float | None, quantized: bool):
        self.inner, self.flops_per_token, self.peak_flops, self.quantized = inner, flops_per_token, peak_flops, quantized

    def log(self, metrics: dict, step: int) -> None:
        self.inner.log(counted(metrics, self.flops_per_token, self.peak_flops, self.quantized), step)

    def close(self) -> None:
        self.inner.close()


class JsonlLogger(BaseLogger):
    def _log_validation(self, metrics: dict, step: int) -> None:
        """val_loss (and its throughput) joins the step's record: one record per step stays true."""
        fields = {"val_loss": metrics["validation_metrics/loss"],
                  "val_tokens_per_s": metrics["validation_metrics/throughput(tps)"] * self.world_size}
        with open(self.path, "rb+") as f:
            data = f.read()
            start = data.rstrip(b"\n").rfind(b"\n") + 1  # the last record's first byte
            rec = json.loads(data[start:])
            if rec.get("step") != step:  # no record of this step (logging.log_freq > 1): one of its own
                start, rec = len(data), {"step": step}
            rec.update(fields)
            f.seek(start)
            f.truncate()
            f.write((json.dumps(rec) + "\n").encode())
        self.progress.log_validation({"step": step, **fields})

    def __init__(self, path: str, world_size: int, total_steps: int, color: bool, t_start: float | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.world_size, self.total_steps, self.color = world_size, total_steps, color
        self._first = True
        self.t_start = time.perf_counter() if t_start is None else t_start  # framework.train.run.train's start
        self.pending_tokens: int | None = None  # set by ApiaryMetrics.log: tokens since the previous record
        self.device, self.peak_flops = devices.device_name(), devices.peak_flops()
        self.progress = progress.Progress(total_steps, color=color, t_start=self.t_start)

    def close(self) -> None:
        self.progress.close()

    def log(self, metrics: dict, step: int) -> None:
        if "validation_metrics/loss" in metrics:  # torchtitan's validator, after the step's own record
            self._log_validation(metrics, step)
            return
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
            "tokens": self.pending_tokens,
            # apiary's count (counted): no GPU, no claim
            "tflops_per_gpu": metrics.get("tflops") if devices.has_accelerator() else None,
            "tflops_per_gpu_torchtitan": metrics.get(TORCHTITAN_TFLOPS) if devices.has_accelerator() else None,
            "mfu_pct": metrics.get("mfu(%)"),  # apiary's count against peak_tflops_per_gpu; None without a peak
            "peak_tflops_per_gpu": self.peak_flops / 1e12 if self.peak_flops else None,
            "device": self.device,
            "step_time_s": metrics["time_metrics/end_to_end(s)"],
            "elapsed_s": round(time.perf_counter() - self.t_start, 3),
            "peak_mem_bytes": devices.peak_memory_bytes(),
            "peak_mem_kind": devices.peak_memory_kind(),
            **devices.allocator_counters(),  # CUDA: peak_alloc_bytes, alloc_retries
            "lr": next((v for k, v in metrics.items() if k.startswith("lr")), None),
            **{k: v for k, v in metrics.items() if k.startswith(("policy/", "data/", "publish/"))},
            **{k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("kernels/")},
            **{k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("health/")},  # skipped steps
            # apiary's recompute_fallbacks; torchtitan's device-memory monitor (max_active(GiB), num_ooms, ...)
            # only on a GPU: on the CPU it reads no device and its fields came out as -9e-10 and -1
            **{k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("memory/")
               and (devices.has_accelerator() or k.split("/", 1)[1] not in TORCHTITAN_DEVICE_MEMORY)},
            **{k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("first_step/")},
        }
        if "first_step_wall_s" in rec:
            rec["first_step_autotune_slowest"] = first_step.STATE.slowest
        self.pending_tokens = None
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.progress.log(rec)
        if "first_step_wall_s" in rec:
            self.progress.note(first_step.describe(rec))


SUPERSEDED_NAME = "metrics.superseded.jsonl"


def supersede(path: Path, first_step: int) -> int:
    """Move the records of ``path`` with step >= ``first_step`` (written by an earlier run of this
    directory past the checkpoint this run resumed from) to ``metrics.superseded.jsonl`` beside it,
    appended in their order; the rest stays, rewritten atomically. Returns how many moved."""
    if not path.is_file():
        return 0
    keep, moved, unreadable = [], [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut short by a crash: not a record of any step
            moved.append(line)
            unreadable += 1
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
    records = len(moved) - unreadable
    when = "before this resume" if first_step > 1 else "by an earlier run in this folder"  # a fresh run: step 1
    what = " and ".join(x for x in (f"{records} record(s) from step {first_step} on, written {when}" if records else "",
                                     f"{unreadable} unreadable line(s) (cut short by a crash)" if unreadable else "") if x)
    _console.print(f"{path.name}: {what}, moved to {aside.name}")
    return len(moved)


class ApiaryMetrics(MetricsProcessor):
    """torchtitan's MetricsProcessor plus metrics.jsonl and the console line (rank 0)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_path: str = "metrics.jsonl"
        total_steps: int = 0
        flops_per_token: float | None = None
        """model FLOPs per trained token, the planner's count (framework.plan.planner.model_flops_per_token,
        computed once by framework.train.build): the logged tflops_per_gpu and mfu_pct; None: none logged"""

    extra_source = None  # callable -> dict of extra scalars for each logged step (policy metrics)
    max_loss_source = None  # callable -> max loss over data parallel, replacing torchtitan's (under CP)
    stage_loss_source = None  # callable(loss) -> the last pipeline stage's loss on every stage (with PP)
    log_wrapper = None  # callable(log, step, avg, max, grad_norm, extra_metrics=None) -> what log returns (skips)
    _jsonl = None  # rank 0's JsonlLogger

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        # MFU against this device's real peak (framework.devices.peak_flops), not torchtitan's A100
        # fallback; no known peak (the CPU, an unlisted GPU): no MFU, through torchtitan's own switch
        # for quantized runs (whose MFU against the BF16 peak it already leaves out)
        peak = devices.peak_flops()
        # apiary's FLOPs count in every logger; torchtitan's kept beside it, labelled
        self.logger = Counted(self.logger, config.flops_per_token, peak, quantized=self.has_quantization)
        if peak is None:
            self.has_quantization = True
        else:
            self.gpu_peak_flops = peak

    _timed_from: int | None = None  # the step whose end torchtitan's timer (time_last_log) was last reset at

    def should_log(self, step: int) -> bool:
        """torchtitan's steps (the first, every logging.log_freq) and the last: the summary, the plot and
        a resume's records end at the step the run reached, whatever log_freq."""
        if self._timed_from is None:  # train_step asks first, at this process's first step (after a resume too)
            self._timed_from = step - 1
        return super().should_log(step) or step == self.config.total_steps

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        """torchtitan's log; through ``log_wrapper`` where the trainer set one (``training.on_nonfinite=skip``:
        the skipped-step metrics)."""
        if self.log_wrapper is not None:
            return self.log_wrapper(self._log_on_grid, step, global_avg_loss, global_max_loss, grad_norm,
                                    extra_metrics=extra_metrics)
        return self._log_on_grid(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    def _log_on_grid(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        """torchtitan divides the time since its timer's reset (the previous record or validation) by log_freq to
        get step_time_s; here by the steps run since then: 1 at step 1, log_freq - 1 at the first grid step after
        it, fewer at an off-grid last step or after a validation between records."""
        since, freq = step - (self._timed_from if self._timed_from is not None else step - 1), self.config.log_freq
        self.config.log_freq = max(since, 1)
        try:
            return self._log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        finally:
            self.config.log_freq, self._timed_from = freq, step

    def _log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if self._jsonl is not None:  # tokens of every data-parallel rank since the last record
            pd = self.parallel_dims
            self._jsonl.pending_tokens = int(self.ntokens_since_last_log * pd.world_size // pd.non_data_parallel_size)
        if self.max_loss_source is not None:  # a collective: every rank calls log
            global_max_loss = self.max_loss_source()
        if self.extra_source is not None:
            extra_metrics = {**(extra_metrics or {}), **self.extra_source()}
        extra_metrics = {**(extra_metrics or {}), **{f"kernels/{k}": v for k, v in kernel_cache.LOG.take().items()},
                         **{f"first_step/{k}": v for k, v in first_step.STATE.record().items()},
                         **{f"publish/{k}": v for k, v in publish.LOG.take().items()}}
        return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    def log_validation(self, loss, step, extra_metrics=None):
        if self.stage_loss_source is not None:  # a collective: every rank validates and calls this
            loss = self.stage_loss_source(loss)
        try:
            return super().log_validation(loss=loss, step=step, extra_metrics=extra_metrics)
        finally:
            self._timed_from = step  # torchtitan's timer restarts here too

    def _build_metric_logger(self, *, config, parallel_dims, **kwargs):
        inner = super()._build_metric_logger(config=config, parallel_dims=parallel_dims, **kwargs)
        if torch.distributed.get_rank() != 0:
            return inner
        container = inner if isinstance(inner, LoggerContainer) else LoggerContainer()
        if container is not inner:
            container.add_logger(inner)
        self._jsonl = JsonlLogger(config.jsonl_path, parallel_dims.world_size, config.total_steps,
                                  not config.disable_color_printing, t_start=first_step.STATE.t_begin)
        container.add_logger(self._jsonl)
        return container
