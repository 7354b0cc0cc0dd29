"""Follow mode (``data.follow=true``) of apiary's Trainer: before each step, wait until every rank's
followed dataset (a ``contracts.FollowedData``) can form the step's rows; stop on a signal (75),
``data.wait_timeout`` (77) or a malformed shard (2) with the last complete step checkpointed; after
the step, write the stream's ledger. A mixin of ``framework.train.trainer.ApiaryTrainer``, whose
``_agree``, ``config``, ``checkpointer`` and ``step`` it uses.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torchtitan.components.dataloader import DataloaderExhaustedError

from framework import contracts
from framework.errors import EXIT_DATA_TIMEOUT, EXIT_USER_ERROR
from framework.report import metrics
from framework.train import preempt

WAIT_NOTE_S = 10.0  # follow mode: the waiting line's period on a terminal (the first after WAIT_FIRST_NOTE_S)
WAIT_FIRST_NOTE_S = 1.0
# not a terminal (a log file, a pipe): the waiting line at these waited seconds, then every WAIT_PIPED_EVERY_S
# (was: every 10 s, 61 lines in 10 minutes)
WAIT_PIPED_AT_S, WAIT_PIPED_EVERY_S = (10.0, 30.0, 60.0), 60.0
RAN_OUT = "Ran out of data; last step was canceled."  # torchtitan's line once a followed run stopped waiting
WAIT_POLL_S = 0.2  # follow mode: how often the folder is looked at while waiting


@dataclass(frozen=True)
class FollowStop:
    """Why a followed run (``data.follow``) stopped waiting for data, before step ``trainer.step + 1``
    ran: the trainer's ``follow_stop`` once its loop ended that way (None otherwise). framework/train/run.py
    turns it into the summary line, ``status.json`` and the process's exit code."""

    why: str  # "signal" (preemption while waiting), "timeout" (data.wait_timeout) or "malformed" (a bad shard)
    exit_code: int  # preempt.EXIT_CODE (75), EXIT_DATA_TIMEOUT (77) or EXIT_USER_ERROR (2)
    message: str  # the paragraph rank 0 printed: what stopped it, the checkpoint, how to go on
    detail: str = ""  # what the summary line adds: "; N record(s) dropped as stale ..." ("": nothing)


def dist_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def next_note_s(waited: float, tty: bool) -> float:
    """The waited seconds at which the next waiting line is due, one having been said at ``waited``
    (-1: none yet): on a terminal after 1 s and every 10 s; otherwise at 10, 30, 60 s, then every 60 s."""
    if tty:
        return WAIT_FIRST_NOTE_S if waited < 0 else waited + WAIT_NOTE_S
    return next((t for t in WAIT_PIPED_AT_S if t > waited), waited + WAIT_PIPED_EVERY_S)


class _RanOutOnce(logging.Filter):
    """Drops torchtitan's "Ran out of data" line once, after apiary said why the followed run stopped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg) != RAN_OUT:
            return True
        logging.getLogger().removeFilter(self)
        return False


class FollowMode:
    """The follow-mode steps of the trainer (see the module docstring)."""

    def _followed(self):
        ds = getattr(self.dataloader, "dataset", None)
        return ds if isinstance(ds, contracts.FollowedData) else None

    def _wait_for_data(self) -> None:
        """Before step ``self.step``: every rank's dataset can form the step's rows (agreed over ranks).
        While it cannot, rank 0 says so (``next_note_s``); a signal (SIGTERM, SIGUSR1, Ctrl-C) or
        ``data.wait_timeout`` seconds without the rows stop the run with the last complete step
        checkpointed (exit 75, or 77 for the timeout); a malformed shard stops it the same way (exit 2,
        naming file and line). Nothing of this step has run when it stops."""
        ds = self._followed()
        if ds is None:
            return
        self._follow_source = ds
        t0 = time.monotonic()
        tty = sys.stdout.isatty()
        note_at = next_note_s(-1, tty)
        folder = ds.dir
        flushed = False
        while True:
            error = ""
            try:
                ok = ds.ready()
            except ValueError as e:
                ok, error = False, str(e)
            waited = time.monotonic() - t0
            bad, missing, stop, timed_out = self._agree([bool(error), not ok, preempt.requested(),
                                                        waited > self.config.follow_wait_timeout])
            if bad:
                self._stop_following("malformed", error or "a rollout shard on another rank is malformed")
            if not missing:
                self._waited_s = waited
                return
            if not flushed:  # the rollouts may need the trainer's newest weights: a deferred version goes first
                flushed = True
                self.flush_publication()
            if stop:
                self._stop_following("signal", "")
            if timed_out:
                held, limit = ds.held(), f"data.wait_timeout={self.config.follow_wait_timeout:g}"
                dropped = ds.waiting_note().removeprefix(f"; {held}" if held else "")  # e.g. records dropped as stale
                self._stop_following("timeout", (f"not enough {ds.NOUN} for step {self.step} in {folder} after "
                                                 f"{waited:.0f} s ({limit}): {held}" if held else
                                                 f"no {ds.NOUN} for step {self.step} in {folder} for {waited:.0f} s "
                                                 f"({limit})") + dropped, detail=dropped)
            if waited >= note_at and dist_rank() == 0:
                note_at = next_note_s(waited, tty)
                print(f"waiting for {ds.NOUN} in {folder}: {waited:.0f} s (step {self.step}{ds.waiting_note()})",
                      flush=True)
            time.sleep(WAIT_POLL_S)

    def _stop_following(self, why: str, message: str, detail: str = "") -> None:
        """Stop before step ``self.step`` ran: checkpoint the last complete step, then leave the loop
        (torchtitan's loop ends on DataloaderExhaustedError)."""
        self.step -= 1
        guard = self.preempt_guard
        ck = self.checkpointer
        if not ck.enable:
            note = "checkpointing is off (checkpoint.enable=false): a rerun starts over"
        elif self.step == 0:  # a fresh run: nothing to start from, nothing to save
            note = "no checkpoint was written (no step trained)"
        elif self.step == self._start_step:
            note = f"no step trained since the start (step {self.step}); the checkpoint it started from stays"
        elif guard is not None and guard.last_saved == self.step:  # complete once renamed to step-N
            note = (f"checkpoint step-{self.step} already written" if preempt.complete(ck, self.step)
                    else f"checkpoint step-{self.step} NOT saved")
        else:
            note = (f"checkpoint step-{self.step} saved" if preempt.force_save(ck, self.step)
                    else f"checkpoint step-{self.step} NOT saved")
        code = {"signal": preempt.EXIT_CODE, "timeout": EXIT_DATA_TIMEOUT, "malformed": EXIT_USER_ERROR}[why]
        if why == "signal" and guard is not None:
            guard.stopped_at, guard.saved = self.step, True
            message = f"stopped on a signal while waiting for {self._follow_source.NOUN}"
        if ck.enable and self.step == 0:  # nothing to resume (a resume is refused): the same command starts over
            then = ", so there is nothing to resume: run the same command again without checkpoint.resume" + (
                " once the generator writes" if why == "timeout" else
                " after fixing or removing that shard" if why == "malformed" else "")
        else:
            then = f"; the rollout position of step {self.step} is kept" + (
                "; fix or remove that shard (later shards are untouched), then resume with "
                f"{self.config.resume_hint or 'checkpoint.resume=true'}" if why == "malformed" else "")
        self.follow_stop = FollowStop(why, code, detail=detail, message=f"apiary: {message}; {note}{then}. Exit code {code}.")
        if dist_rank() == 0:
            print(self.follow_stop.message, file=sys.stderr, flush=True)
        root = logging.getLogger()  # torchtitan's loop logs it on this exception: said above (one filter at a time)
        if not any(isinstance(f, _RanOutOnce) for f in root.filters):
            root.addFilter(_RanOutOnce())
        raise DataloaderExhaustedError()

    def _write_ledger(self) -> None:
        """The followed stream's ledger (its LEDGER file): the records each step trained (rank 0; a
        resume moves the re-trained steps' lines aside)."""
        report = self._follow_source.step_report(self.step)
        if report is None or dist_rank() != 0:
            return
        path = Path(self.config.dump_folder) / self._follow_source.LEDGER
        if not self._ledger_started:
            self._ledger_started = True
            metrics.supersede(path, self.step)
        with open(path, "a") as f:
            f.write(json.dumps({"step": self.step, "waited_s": round(self._waited_s, 3), **report}) + "\n")
