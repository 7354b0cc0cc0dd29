"""stdout's reader left (`train | head`, `train 2>&1 | head`, `apiary ls | head`): a command ends
quietly with ``EXIT_BROKEN_PIPE`` (141, what a shell reports for a writer ended by SIGPIPE), without a
traceback or a message, as other command-line tools do; a training run stops as on SIGTERM instead
(``stop_training``: it checkpoints at the next step boundary, writes its summary.json and exits 75),
since ending it at its next print lost every step since its last save (was: 141, no checkpoint).

* ``on_broken_pipe``, set by the `train` and `apiary` entry points through ``compat.route_broken_pipe``
  as rich's hook on the ``Console`` class (the consoles are made in many modules), makes every rich
  console of the process end it this way on a closed pipe (rich's own default exits 1, which reads as
  a failure) after pointing the closed streams at /dev/null, so that nothing said later (a summary,
  Python's last flush) fails again.
* ``guard_streams`` (the `train` entry point) does the same for a plain ``print`` in any thread (the
  sender's, the first step's notes, the publisher's): the stream goes quiet instead of raising.
* What goes on, silenced, instead of exiting (``_goes_on``): a process whose training loop runs
  (``stop_training`` asks it to stop at the next step boundary, as SIGTERM does; every rank agrees on
  the stop, so no rank leaves alone); a rank of a run a ``train`` parent supervises (nproc > 1), whose
  parent, watching the same pipe (``reader_gone``), stops the run the same way; a process already
  stopping on a signal (it writes its checkpoint first); a thread other than the main one.
"""

from __future__ import annotations

import os
import sys
import threading

from rich.console import Console

from framework.errors import EXIT_BROKEN_PIPE
from framework.launch.lifecycle import STATUS_ENV, reader_gone


def stop_requested() -> bool:
    """Whether this process is stopping gracefully (a preemption signal: it checkpoints first); the
    training entry point sets it to framework.train.preempt's ``requested``."""
    return False


def stop_training() -> bool:
    """Ask this process's training loop to stop as SIGTERM would (a checkpoint at the next step boundary,
    exit 75); False when no training loop is hooked here (nothing to save: the command ends quietly). The
    training entry point sets it to framework.train.preempt's ``stop_for_closed_pipe``."""
    return False


def silence() -> None:
    """Point each of stdout and stderr whose reader has gone at /dev/null (both for `2>&1 | head`)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                fd = stream.fileno()
            except (AttributeError, ValueError, OSError):  # a replaced stream (pytest's capture)
                continue
            if reader_gone(fd):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def quiet_exit() -> None:
    """Say nothing more and exit ``EXIT_BROKEN_PIPE``."""
    silence()
    raise SystemExit(EXIT_BROKEN_PIPE)


def _goes_on() -> bool:
    """Whether a process whose reader left keeps running, silenced: a supervised rank (the parent stops
    the run), a process stopping gracefully (its checkpoint comes first), or a thread other than the main
    one (a transfer, a notes thread: only the main thread ends the process)."""
    return bool(os.environ.get(STATUS_ENV)) or stop_requested() or threading.current_thread() is not threading.main_thread()


def on_broken_pipe(console: Console) -> None:
    """``Console.on_broken_pipe`` for every console of the process (module docstring)."""
    console.quiet = True
    silence()
    if stop_training() or _goes_on():
        return
    quiet_exit()


class _Guarded:
    """A text stream whose write or flush into a pipe whose reader left silences the process's streams
    instead of raising BrokenPipeError (a plain ``print`` in any thread), then exits 141 as a console
    would where the process does not go on (``_goes_on``)."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self) -> None:
        silence()
        if not (stop_training() or _goes_on()):
            raise SystemExit(EXIT_BROKEN_PIPE)

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard_streams() -> None:
    """Wrap sys.stdout and sys.stderr (once) in ``_Guarded``."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Guarded):
            setattr(sys, name, _Guarded(stream))
