"""Where the first step's time goes: printed once (rank 0) after the first step a process trains,
and recorded in that step's metrics.jsonl record.

* ``first_step_build_s``: from the start of ``framework.train.run.train`` to the first step (model init,
  parallelize, optimizer, dataloader, checkpoint load); not part of the step's wall time, nor are:
* ``first_step_data_wait_s``: follow mode (``data.follow=true``), the time the first step waited
  for its first records (the generator's first shard);
* ``first_step_publish_s``: with ``publish``, writing the starting weights (``step-0``) before it.
* ``first_step_wall_s``: the first step, from ``train_step`` to its metrics record.
* ``first_step_compile_s``: Dynamo/Inductor compile time inside that step (torch's own timers,
  ``torch._dynamo.utils.compilation_time_metrics``: each frame's ``_compile.compile_inner`` plus
  lazily compiled backwards, ``backward._backward_impl``); inductor's tuning of flex attention
  happens inside it. 0 where nothing is compiled (apiary's CPU path).
* ``first_step_autotune_s`` / ``first_step_autotuned_kernels``: Triton's runtime autotuning in that
  step (framework.train.kernel_cache.AutotuneLog), including ``first_step_autotune_wait_s``: time spent
  waiting for another process sharing the cache to finish tuning the same kernel (its lock).
* ``first_step_autotune_from_table``: kernel/key pairs Triton tuned over a recorded table's winners
  only (``training.autotune_configs=recorded``, framework/train/autotune_table.py);
  ``first_step_autotune_slowest`` (metrics.jsonl only): the three kernels whose tuning took longest.
* ``first_step_other_s``: the rest (first-iteration allocations, the kernels' own run time, the
  optimizer, communication).

compile + autotune + other = wall (each clamped to be non-negative, so the parts never exceed it).

A first step still running after ``NOTE_EVERY_S`` says so on rank 0, and again each time that passes:
the compile and autotuning seconds so far, the kernels tuned and the one being tuned now (a fresh
machine's first step of a model with many Triton kernels autotunes for minutes, which looked like a hang);
when no kernel is being tuned, where the training thread is (its innermost frames: ``where_now``).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from framework.train import autotune_table, kernel_cache

_COMPILE_KEYS = ("_compile.compile_inner", "backward._backward_impl")
NOTE_EVERY_S = 60.0  # a first step running longer says so, once per period (rank 0)


def compile_seconds() -> float:
    """Seconds this process spent in Dynamo/Inductor compilation so far (0 if torch never compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    metrics = getattr(utils, "compilation_time_metrics", {}) or {}
    return float(sum(sum(metrics.get(k, ())) for k in _COMPILE_KEYS))


class FirstStep:
    def __init__(self):
        self._stop: threading.Event | None = None
        self.reset()

    def reset(self) -> None:
        self._stop_notes()
        self.t_begin = self.t_step = None
        self.data_wait = self.publish = 0.0  # before the first step, not building the trainer
        self.compile0 = self.autotune0 = self.wait0 = 0.0
        self.tuned0 = self.table0 = 0
        self.by_kernel0: dict[str, float] = {}
        self.slowest: dict[str, float] = {}
        self.thread: int | None = None  # the thread training the step (where_now reads its stack)
        self.done = False

    def begin(self) -> None:
        """The trainer starts to be built (framework.train.run.train)."""
        self.reset()
        self.t_begin = time.perf_counter()

    def before_first_step(self, *, data_wait_s: float = 0.0, publish_s: float = 0.0) -> None:
        """Time spent before the first step that is not building the trainer: waiting for the first
        records (follow mode), publishing the starting weights. Ignored once a step started."""
        if self.t_step is None and not self.done:
            self.data_wait += max(data_wait_s, 0.0)
            self.publish += max(publish_s, 0.0)

    def step_started(self) -> None:
        """A train step starts; only the first one counts."""
        if self.t_step is not None or self.done:
            return
        self.t_step = time.perf_counter()
        self.thread = threading.get_ident()
        self.compile0 = compile_seconds()
        self.autotune0, self.tuned0 = kernel_cache.LOG.total_seconds, kernel_cache.LOG.total_tuned
        self.wait0 = kernel_cache.LOG.total_wait_seconds
        self.by_kernel0 = dict(kernel_cache.LOG.by_kernel)
        self.table0 = autotune_table.COUNTS.exact + autotune_table.COUNTS.union
        if NOTE_EVERY_S > 0 and os.environ.get("RANK", "0") == "0":
            self._stop = threading.Event()
            threading.Thread(target=self._notes, args=(self._stop, NOTE_EVERY_S), name="apiary-first-step",
                             daemon=True).start()

    def _notes(self, stop: threading.Event, every: float) -> None:
        while not stop.wait(every):
            print(self.progress_line(), flush=True)

    def _stop_notes(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    def progress_line(self) -> str:
        """The first step so far, while it runs: its seconds, compile and autotuning so far, the kernel
        being tuned now (known where the autotuning results are cached: kernel_cache.tune_lock)."""
        parts = []
        compile_s = max(compile_seconds() - self.compile0, 0.0)
        if compile_s:
            parts.append(f"compile {compile_s:.0f} s")
        log = kernel_cache.LOG
        tuned, now = log.total_tuned - self.tuned0, log.tuning_now
        if tuned or now:
            tuning = max(log.total_seconds - self.autotune0 + log.total_wait_seconds - self.wait0, 0.0)
            parts.append(f"autotuning {tuning:.0f} s: {tuned} kernel{'s' if tuned != 1 else ''} tuned"
                         + (f", tuning {now} now" if now else ""))
        if not now and (where := where_now(self.thread)):
            parts.append(f"now in {where}")
        so_far = f"first step: still running after {time.perf_counter() - self.t_step:.0f} s"
        return so_far + (f" ({'; '.join(parts)})" if parts else "") + "; its breakdown follows when it ends"

    def record(self) -> dict:
        """The breakdown, once (at the first logged step after step_started); {} otherwise."""
        if self.done or self.t_step is None:
            return {}
        self.done = True
        self._stop_notes()
        self.slowest = self._slowest()  # not a scalar: metrics.jsonl only (JsonlLogger), not the other loggers
        now = time.perf_counter()
        wall = now - self.t_step
        before = self.t_step - self.t_begin if self.t_begin is not None else 0.0
        build = max(before - self.data_wait - self.publish, 0.0)
        compile_s = min(max(compile_seconds() - self.compile0, 0.0), wall)
        wait = max(kernel_cache.LOG.total_wait_seconds - self.wait0, 0.0)
        autotune = min(max(kernel_cache.LOG.total_seconds - self.autotune0, 0.0) + wait, wall - compile_s)
        other = max(wall - compile_s - autotune, 0.0)
        waits = {"first_step_data_wait_s": round(self.data_wait, 3)} if self.data_wait else {}
        if self.publish:
            waits["first_step_publish_s"] = round(self.publish, 3)
        return {"first_step_build_s": round(build, 3), **waits, "first_step_wall_s": round(wall, 3),
                "first_step_compile_s": round(compile_s, 3), "first_step_autotune_s": round(autotune, 3),
                "first_step_autotuned_kernels": kernel_cache.LOG.total_tuned - self.tuned0,
                "first_step_autotune_wait_s": round(min(wait, autotune), 3),
                "first_step_other_s": round(other, 3),
                "first_step_autotune_from_table": autotune_table.COUNTS.exact + autotune_table.COUNTS.union - self.table0}

    def _slowest(self, n: int = 3) -> dict[str, float]:
        """The ``n`` kernels whose tuning took longest in this step (seconds, all their keys)."""
        spent = {k: v - self.by_kernel0.get(k, 0.0) for k, v in kernel_cache.LOG.by_kernel.items()}
        top = sorted((v, k) for k, v in spent.items() if v > 0)[::-1][:n]
        return {k: round(v, 2) for v, k in top}


def describe(rec: dict) -> str:
    """The console's first-step line: only the parts that took time (on apiary's CPU path nothing is
    compiled or tuned, so it says the step's time and the build's)."""
    parts = []
    if rec.get("first_step_compile_s"):
        parts.append(f"compile {rec['first_step_compile_s']:.1f} s")
    if rec.get("first_step_autotune_s") or rec.get("first_step_autotuned_kernels"):
        slowest = rec.get("first_step_autotune_slowest") or {}
        detail = [f"{rec.get('first_step_autotuned_kernels', 0)} kernels tuned"]
        if rec.get("first_step_autotune_from_table"):
            detail.append(f"{rec['first_step_autotune_from_table']} over recorded winners only")
        if rec.get("first_step_autotune_wait_s"):
            detail.append(f"{rec['first_step_autotune_wait_s']:.1f} s waiting for another process's tuning")
        if slowest:
            detail.append("longest: " + ", ".join(f"{k} {v:.1f} s" for k, v in slowest.items()))
        parts.append(f"autotuning {rec['first_step_autotune_s']:.1f} s ({'; '.join(detail)})")
    split = (" = " + " + ".join(parts + [f"other {rec['first_step_other_s']:.1f} s"])) if parts else ""
    before = [f"building the trainer before it took {rec['first_step_build_s']:.1f} s"]
    if rec.get("first_step_publish_s"):
        before.append(f"publishing the starting weights {rec['first_step_publish_s']:.1f} s")
    if rec.get("first_step_data_wait_s"):
        before.append(f"waiting for the first records {rec['first_step_data_wait_s']:.1f} s")
    return f"first step: {rec['first_step_wall_s']:.1f} s{split}; " + ", ".join(before)


def where_now(thread: int | None, depth: int = 3) -> str:
    """Where ``thread`` is at this moment: its innermost ``depth`` Python frames, innermost first, each
    ``function (package/file.py:line)``, and apiary's innermost frame when none of those is apiary's; a step
    that neither compiles nor tunes yet runs long (a kernel that waits, a collective no peer joins, a lock)
    is then found from the log alone. '' when unknown."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    out, ours = [], None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/").split("/")
        where = f"{frame.f_code.co_name} ({'/'.join(path[-2:])}:{frame.f_lineno})"
        if len(out) < depth:
            out.append(where)
        elif ours is None and ("framework" in path or "components" in path):  # the innermost frame of apiary's
            ours = where
        frame = frame.f_back
    return " < ".join(out) + (f" ... < {ours}" if ours and not any(
        ("framework/" in w or "components/" in w) for w in out) else "")


STATE = FirstStep()
