"""The run's console while it trains (rank 0, fed by framework/report/metrics.py's JsonlLogger): one line
per logged step, and in a terminal a live progress line under them.

* In a terminal (stdout is a TTY, ``SLURM_JOB_ID`` unset, ``TERM`` not ``dumb``): each logged step's
  line is printed as it comes, and a rich ``Live`` line at the bottom is redrawn in place once a
  second: step/total with a bar, elapsed, ETA, tok/s, loss (and val_loss once a record has one;
  an RL run's mean reward once a record has one).
* Piped, redirected or under Slurm: the same per-step lines with elapsed and ETA appended, one
  line per logged step, never a control code (log files stay greppable).

Elapsed counts from the start of training in this process (``framework.train.run.train``: building the
trainer included). The ETA is the steps left times the time per step measured since this
process's first logged step (so the first step's compile and warm-up do not inflate it); at the
first logged step it is that step's own time.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time

from rich.console import Console
from rich.live import Live
from rich.text import Text

# devices.peak_memory_kind() -> what the peak memory number is, short (step lines) and long (the
# summary); both measured by rank 0's process (kept here: no torch import)
MEMORY_LABELS = {"cuda_max_memory_reserved": "torch reserved", "cpu_max_rss": "max RSS"}
MEMORY_LABELS_LONG = {"cuda_max_memory_reserved": "torch max reserved on rank 0's GPU",
                      "cpu_max_rss": "max RSS of rank 0's process"}


def memory_label(kind: str | None, long: bool = False) -> str:
    return (MEMORY_LABELS_LONG if long else MEMORY_LABELS).get(kind or "", kind or "unknown kind")


def duration(seconds: float | None) -> str:
    """``m:ss`` below an hour, ``h:mm:ss`` above; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def interactive(console: Console) -> bool:
    """Whether the live line may be drawn: the console writes to a terminal (a real TTY: not a
    pipe, even with FORCE_COLOR) that is not dumb, outside a Slurm job (whose output goes to a file,
    also under ``srun --pty``)."""
    isatty = getattr(console.file, "isatty", None)
    return bool(console.is_terminal and not console.is_dumb_terminal and isatty is not None and isatty()
                and not os.environ.get("SLURM_JOB_ID"))


def make_console() -> Console:
    """A console for this process's stdout: rich's own in a terminal, else one that writes plain
    text (no colour or cursor codes, even with FORCE_COLOR; nor under Slurm)."""
    c = Console(highlight=False)
    if interactive(c):
        return c
    return Console(highlight=False, color_system=None, force_terminal=False, force_interactive=False)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def loss_text(x) -> str:
    """A loss for the console: 4 decimals, but 3 significant digits in scientific notation below 1e-3 (a
    policy loss sits near 0: it printed `-0.0000`) and never a negative zero; nan/inf as Python writes them."""
    if not _num(x) or not math.isfinite(x):
        return str(x)
    if x == 0 or abs(x) >= 1e-3:
        return f"{x + 0.0:.4f}"  # + 0.0: -0.0 becomes 0.0
    return f"{x:.2e}"


def step_text(rec: dict, total: int) -> str:
    """One logged step as text (without elapsed and ETA)."""
    parts = [f"step {rec['step']:>5}/{total}", f"loss {loss_text(rec['loss'])}", *rl_parts(rec)]
    if _num(rec.get("val_loss")):
        parts.append(f"val_loss {rec['val_loss']:.4f}")
    if _num(rec.get("grad_norm")):
        parts.append(f"grad_norm {rec['grad_norm']:.3f}")
    if _num(rec.get("tokens_per_s")):
        parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
    if _num(rec.get("tflops_per_gpu")):  # None on CPU: no GPU to claim TFLOPs for
        parts.append(f"{rec['tflops_per_gpu']:.1f} TFLOPs/GPU")
    if _num(rec.get("mfu_pct")):  # None where the device has no known peak
        parts.append(f"MFU {rec['mfu_pct']:.1f}%")
    if _num(rec.get("peak_mem_bytes")):
        parts.append(f"peak {rec['peak_mem_bytes'] / 2**30:.2f} GiB {memory_label(rec.get('peak_mem_kind'))}")
    if _num(rec.get("step_time_s")):
        parts.append(f"{rec['step_time_s']:.3f} s/step")
    return "  ".join(parts) + autotune_note(rec)


def rl_parts(rec: dict) -> list[str]:
    """An RL step's own numbers, those the record has: the mean reward of the records it trained
    (``data/reward_mean``), their lag behind the trainer's version (follow mode: mean, max), the
    training-inference mismatch (``policy/mismatch_abs_mean``: mean |logp_gen - logp_train|) and the KL
    to the reference (``policy/kl_mean``, with a KL term)."""
    parts = []
    if _num(rec.get("data/reward_mean")):
        parts.append(f"reward {rec['data/reward_mean']:.4g}")
    if _num(rec.get("data/lag_mean")):
        parts.append(f"lag {rec['data/lag_mean']:.2g}" + (f" (max {rec['data/lag_max']:g})"
                                                          if _num(rec.get("data/lag_max")) else ""))
    if _num(rec.get("policy/mismatch_abs_mean")):
        parts.append(f"mismatch {rec['policy/mismatch_abs_mean']:.2e}")
    if _num(rec.get("policy/kl_mean")):
        parts.append(f"kl {rec['policy/kl_mean']:.2e}")
    return parts


def autotune_note(rec: dict) -> str:
    """What Triton's autotuning cost in this step, only when it tuned or read something."""
    if not rec.get("autotuned_kernels") and not rec.get("autotune_cache_hits"):
        return ""
    return (f"  (autotuning {rec['autotune_s']:.1f} s: {rec['autotuned_kernels']} kernels tuned, "
            f"{rec['autotune_cache_hits']} from the disk cache)")


def val_text(rec: dict) -> str:
    text = f"validation at step {rec['step']}: val_loss {rec['val_loss']:.4f}"
    if _num(rec.get("val_tokens_per_s")):
        text += f"  {rec['val_tokens_per_s']:,.0f} tok/s"
    return text


class Progress:
    """Console output of one training process (rank 0). ``log`` takes each training record,
    ``log_validation`` each validation record, ``note`` any other line; ``close`` ends the live line."""

    REFRESH_PER_S = 1.0

    def __init__(self, total_steps: int, *, color: bool = True, console: Console | None = None,
                 live: bool | None = None, t_start: float | None = None, clock=time.perf_counter):
        self.console = console or make_console()
        self.live_mode = interactive(self.console) if live is None else live
        self.total, self.color, self.clock = int(total_steps), color, clock
        self.t_start = clock() if t_start is None else t_start
        self._first: tuple[int, float] | None = None  # (step, elapsed) of this process's first record
        self.step = self.loss = self.tok_s = self.val_loss = self.reward = None
        self._eta, self._eta_at = None, None
        self._live: Live | None = None
        self._moved: list = []  # (log handler, its own stream) while the live line runs

    # -- numbers ---------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self.t_start

    def _update_eta(self, rec: dict, elapsed: float) -> None:
        step = int(rec["step"])
        if self._first is None:
            self._first = (step, elapsed)
        first_step, first_elapsed = self._first
        if step > first_step:
            per_step = (elapsed - first_elapsed) / (step - first_step)
        else:
            per_step = rec.get("step_time_s") if _num(rec.get("step_time_s")) else None
        left = max(self.total - step, 0)
        self._eta = left * per_step if per_step is not None else None
        self._eta_at = elapsed

    def eta(self) -> float | None:
        """Seconds left, counting down from the last record's estimate."""
        if self._eta is None:
            return None
        return max(self._eta - (self.elapsed() - self._eta_at), 0.0)

    # -- output ----------------------------------------------------------------------------
    def log(self, rec: dict) -> None:
        elapsed = self.elapsed()
        self._update_eta(rec, elapsed)
        self.step, self.loss, self.tok_s = int(rec["step"]), rec["loss"], rec.get("tokens_per_s")
        if _num(rec.get("data/reward_mean")):
            self.reward = rec["data/reward_mean"]
        if _num(rec.get("val_loss")):
            self.val_loss = rec["val_loss"]
        line = step_text(rec, self.total)
        if self.live_mode:
            label = f"step {rec['step']:>5}/{self.total}"  # step_text's first part, in colour
            self.console.print(Text.assemble((label, "bold green" if self.color else ""), line[len(label):]),
                               soft_wrap=True)
            self._start_live()
            if self._live is not None:
                self._live.refresh()
        else:
            self._print(f"{line}  elapsed {duration(elapsed)}  ETA {duration(self._eta)}")

    def log_validation(self, rec: dict) -> None:
        self.val_loss = rec["val_loss"]
        self._print(val_text(rec) + ("" if self.live_mode else f"  elapsed {duration(self.elapsed())}"))
        if self._live is not None:
            self._live.refresh()

    def note(self, text: str) -> None:
        self._print(text)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
            for handler, stream in self._moved:
                handler.setStream(stream)
            self._moved = []

    def _print(self, text: str) -> None:
        self.console.print(Text(text), soft_wrap=True)

    # -- the live line -----------------------------------------------------------------------
    def _start_live(self) -> None:
        if self._live is None and self.live_mode:
            self._live = Live(_LiveLine(self), console=self.console, refresh_per_second=self.REFRESH_PER_S,
                              transient=False, redirect_stdout=True, redirect_stderr=True)
            self._live.start()
            self.console.show_cursor(True)  # a second Ctrl-C exits at once (os._exit): never leave it hidden
            # log records (torchtitan's handler on the root logger holds the stream it was made with)
            # go above the live line too, as print() and warnings now do
            proxies = {id(sys.__stdout__): sys.stdout, id(sys.__stderr__): sys.stderr}
            for handler in logging.getLogger().handlers:
                stream = getattr(handler, "stream", None)
                if isinstance(handler, logging.StreamHandler) and id(stream) in proxies:
                    self._moved.append((handler, handler.setStream(proxies[id(stream)])))

    def live_text(self) -> str:
        """The live line's words (after the bar)."""
        pct = 100.0 * self.step / self.total if self.total else 100.0
        parts = [f"{pct:.0f}%", f"elapsed {duration(self.elapsed())}", f"ETA {duration(self.eta())}"]
        if _num(self.tok_s):
            parts.append(f"{self.tok_s:,.0f} tok/s")
        parts.append(f"loss {loss_text(self.loss)}")
        if _num(self.reward):
            parts.append(f"reward {self.reward:.4g}")
        if _num(self.val_loss):
            parts.append(f"val_loss {self.val_loss:.4f}")
        return "  ".join(parts)


class _LiveLine:
    """The live line, rendered afresh at every refresh (elapsed and ETA tick between records): one
    line of text cut at the terminal's width, its bar shrunk first."""

    BAR = 24

    def __init__(self, progress: Progress):
        self.p = progress

    def __rich_console__(self, console, options):
        p = self.p
        label, words = f"step {p.step}/{p.total}", p.live_text()
        width = max(min(self.BAR, options.max_width - len(label) - len(words) - 2), 6)
        done = round(width * min(p.step, p.total) / p.total) if p.total else width
        bar = Text.assemble(("━" * done, "green" if p.color else ""), ("─" * (width - done), "dim" if p.color else ""))
        line = Text.assemble((label, "bold" if p.color else ""), " ", bar, " ", words, no_wrap=True, overflow="ellipsis")
        line.truncate(options.max_width, overflow="ellipsis")
        yield line
