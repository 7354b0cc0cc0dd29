"""stdout's reader left (`train | head`, `train 2>&1 | head`, `apiary ls | head`): the command ends
quietly with ``EXIT_BROKEN_PIPE`` (141, what a shell reports for a writer ended by SIGPIPE), without a
traceback or a message, as other command-line tools do.

* ``on_broken_pipe``, set by the `train` and `apiary` entry points through ``compat.route_broken_pipe`` as rich's hook on the
  ``Console`` class (the consoles are made in many modules), makes every rich console of the process
  end it this way on a closed pipe (rich's own default exits 1, which reads as a
  failure) after pointing the closed streams at /dev/null, so that nothing said later (a summary,
  Python's last flush) fails again.
* A rank of a run a ``train`` parent supervises (nproc > 1) does not exit by itself: its closed streams
  go to /dev/null and it trains on until the parent, which watches the same pipe (``reader_gone``),
  stops torchrun and its ranks at once and exits 141 (a rank leaving alone would make the others fail
  in their next collective, each with a traceback).
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

from framework.errors import EXIT_BROKEN_PIPE
from framework.launch.lifecycle import STATUS_ENV, reader_gone


def silence() -> None:
    """Point stdout, and stderr when its reader has gone too (`2>&1 | head`), at /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                fd = stream.fileno()
            except (AttributeError, ValueError, OSError):  # a replaced stream (pytest's capture)
                continue
            if stream is sys.stdout or reader_gone(fd):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def quiet_exit() -> None:
    """Say nothing more and exit ``EXIT_BROKEN_PIPE``."""
    silence()
    raise SystemExit(EXIT_BROKEN_PIPE)


def on_broken_pipe(console: Console) -> None:
    """``Console.on_broken_pipe`` for every console of the process (module docstring)."""
    console.quiet = True
    if os.environ.get(STATUS_ENV):  # a supervised rank: the parent stops the run (module docstring)
        silence()
        return
    quiet_exit()

