"""User errors (one clear paragraph, exit code 2, before any worker starts) and every exit code
apiary defines."""

from __future__ import annotations

import difflib

# Bad input (a UserError): one paragraph, before any worker starts; also a malformed followed rollout shard.
EXIT_USER_ERROR = 2
# A rank stopped on request (preemption signal) after a checkpoint: run it again (EX_TEMPFAIL, sysexits.h).
EXIT_PREEMPTED = 75
# Training stopped on NaN/Inf: nothing applied, nothing non-finite saved (framework/train/integrity.py).
EXIT_NONFINITE = 76
# A followed rollout folder (data.follow) stayed empty for data.wait_timeout seconds; the last
# complete step was checkpointed: run it again (with checkpoint.resume=true) once the generator writes.
EXIT_DATA_TIMEOUT = 77
# stdout's reader left (`train --cfg job | head -2`): quiet, 128 + SIGPIPE, as a shell reports a piped command's
# end (was: rich's exit 1 with no message). A training run stops as on SIGTERM instead (checkpoint, 75).
EXIT_BROKEN_PIPE = 141
# A second SIGINT (Ctrl-C again): stop at once, no checkpoint (128 + SIGINT, as a shell reports it).
EXIT_STOP_NOW = 130
# The disk of the run folder filled up while the run trained (a checkpoint, metrics.jsonl): the half-written save
# removed, the complete checkpoints kept; free space, then resume (EX_IOERR, sysexits.h). A full disk at launch
# is a UserError (2): nothing started.
EXIT_DISK_FULL = 74


class UserError(Exception):
    """A problem with the user's input. ``str(err)`` is the whole message."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, where: str, reason: str, suggestion: str = ""):
        self.where, self.reason, self.suggestion = where, reason, suggestion
        msg = f"apiary: {where}: {reason}"
        if suggestion:
            msg += f" {suggestion}"
        super().__init__(msg)


class DiskFull(UserError):
    """The run folder's disk filled up while the run trained (framework/train/disk_full.py says it)."""

    exit_code = EXIT_DISK_FULL


def closest(word: str, options, n: int = 3) -> list[str]:
    options = list(dict.fromkeys(options))  # a name listed twice (e.g. `none` of several kinds) is one hint
    hits = difflib.get_close_matches(word, options, n=n, cutoff=0.5)
    if not hits:
        hits = [o for o in options if word.split(".")[-1] in o][:n]
    return hits


def did_you_mean(word: str, options) -> str:
    hits = closest(word, options)
    return f"Did you mean {' or '.join(repr(h) for h in hits)}?" if hits else ""
