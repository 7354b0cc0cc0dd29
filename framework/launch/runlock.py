"""One writer per run directory: an exclusive lock on ``<output_dir>/run.lock`` for the run's life.

The process that starts the run takes it before any worker is spawned: the ``train`` parent (which
then starts torchrun, or trains in-process), ``apiary launch launcher=local``; under a torchrun or
Slurm job that no apiary parent started, global rank 0 takes it before it builds anything
(``APIARY_RUN_LOCK`` in the environment tells a worker that its parent holds it). The lock is an
``fcntl.flock`` on the file, which the kernel drops when the holder dies, and the file names the
holder: host, pid, start time, command, Slurm job id.

A second run on the same directory (a fresh one, or ``checkpoint.resume=true`` while the first
still runs) stops with a UserError (exit 2) naming the holder. A lock left by a process that is
gone (the flock is free but the file still names a holder) is taken over with a warning when that
holder ran on this host, or belonged to this same Slurm job (a requeue onto another node); a
leftover from another host is refused, since apiary cannot tell from here whether it still runs.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from framework import contracts
from framework.errors import UserError
from framework.resolve import disk

LOCK_NAME = "run.lock"
ENV = "APIARY_RUN_LOCK"  # set for workers whose parent holds the lock


def lock_path(output_dir) -> Path:
    return Path(output_dir) / LOCK_NAME


def _record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "started_unix": time.time(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "command": " ".join(sys.argv)}


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    if not raw.strip():
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        return {"unreadable": raw[:200].decode(errors="replace")}
    return rec if isinstance(rec, dict) else {"unreadable": str(rec)[:200]}


def describe(rec: dict | None) -> str:
    if not rec:
        return "another run that is starting (no holder written yet)"
    if "unreadable" in rec:
        return f"an unreadable holder record ({rec['unreadable']!r})"
    job = f", Slurm job {rec['slurm_job_id']}" if rec.get("slurm_job_id") else ""
    return (f"pid {rec.get('pid')} on host {rec.get('host')}{job}, started {rec.get('started')} "
            f"({rec.get('command', '')})")


@dataclass
class RunLock:
    path: Path
    fd: int | None
    took_over: dict | None = None  # the stale holder replaced, if any

    def release(self) -> None:
        """Remove the file (while still holding it) and drop the lock; safe to call twice."""
        if self.fd is None:
            return
        try:
            if self.path.exists() and os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                self.path.unlink()
        except OSError:
            pass
        try:
            os.close(self.fd)  # closing the last descriptor drops the flock
        finally:
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _busy_error(output_dir, path: Path, rec: dict | None) -> UserError:
    return UserError(f"output_dir={output_dir}", f"is in use by {describe(rec)}; two runs writing one "
                     f"directory would interleave metrics.jsonl and overwrite each other's checkpoints "
                     f"(lock {path}).", "Wait for that run to end (or stop it: kill -TERM its pid checkpoints "
                     "and exits), or choose another output_dir.")


def _stale(rec: dict | None) -> tuple[bool, str]:
    """Whether a record left under a free flock may be taken over, and why."""
    if not rec:
        return True, ""
    if "unreadable" in rec:
        return True, "unreadable record"
    if rec.get("host") == socket.gethostname():
        return True, f"its process {rec.get('pid')} is gone"
    job = os.environ.get("SLURM_JOB_ID")
    if job and rec.get("slurm_job_id") == job:
        return True, f"an earlier run of this Slurm job {job}"
    return False, ""


def acquire(output_dir, warn=None) -> RunLock:
    """Take the run directory's lock (creating the directory) or raise UserError naming its holder."""
    out = Path(output_dir)
    path = lock_path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as e:
        if out.exists() and not out.is_dir():
            raise UserError(f"output_dir={output_dir}", "is a file, not a directory.",
                            "Choose a directory for output_dir.") from None
        if e.errno in disk.FULL_ERRNOS:
            raise disk.full_at_launch(f"output_dir={output_dir}", out, "not even the run's lock file "
                                      f"{path} could be made", e) from None
        raise UserError(f"output_dir={output_dir}", f"cannot hold the run's lock file {path} there "
                        f"({e.strerror or e}).", "Choose a writable directory for output_dir.") from None
    for _ in range(10):  # retry when the file was replaced between open and flock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"output_dir={output_dir}", f"cannot open its lock file {path} ({e.strerror or e}).",
                            "Choose a writable directory for output_dir.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            rec = _read(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise _busy_error(output_dir, path, rec) from None
            # the file system has no flock (e.g. Lustre without -o flock): the record alone decides
            if rec and rec.get("host") == socket.gethostname() and _pid_alive(rec.get("pid")):
                os.close(fd)
                raise _busy_error(output_dir, path, rec) from None
            (warn or _warn)(f"apiary: {path.parent} is on a file system without flock ({e.strerror}); the run "
                            "lock is only a record there, checked by pid on this host.")
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the holder released (unlinked) it after we opened: try the new file
            os.close(fd)
            continue
        rec = _read(fd)
        ok, why = _stale(rec)
        if not ok:
            os.close(fd)
            raise UserError(f"output_dir={output_dir}", f"is marked in use by {describe(rec)}; that host's "
                            f"lock is not visible from {socket.gethostname()}, so apiary cannot tell whether "
                            f"it still runs (lock {path}).", f"If that run has ended, delete {path} and "
                            "launch again; otherwise choose another output_dir.")
        lock = RunLock(path, fd, took_over=rec)
        if rec:
            (warn or _warn)(f"apiary: taking over the lock on {out} from {describe(rec)}: {why}.")
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (json.dumps(_record()) + "\n").encode())
            os.fsync(fd)
        except OSError as e:  # a full disk (was: the OSError's traceback): nothing started, no lock left behind
            lock.release()
            if e.errno in disk.FULL_ERRNOS:
                raise disk.full_at_launch(f"output_dir={output_dir}", out, "not even the run's lock file "
                                          f"{path} could be written", e) from None
            raise UserError(f"output_dir={output_dir}", f"cannot write its lock file {path} ({e.strerror or e}).",
                            "Choose a writable directory for output_dir.") from None
        return lock
    raise UserError(f"output_dir={output_dir}", f"its lock {path} keeps changing hands.",
                    "Another run is starting on it; choose another output_dir.")


def check_free(output_dir) -> None:
    """Raise UserError when a live run holds the lock (for launchers that only submit a job)."""
    path = lock_path(output_dir)
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise _busy_error(output_dir, path, _read(fd)) from None
        rec = _read(fd)
        if rec and not _stale(rec)[0]:
            raise UserError(f"output_dir={output_dir}", f"is marked in use by {describe(rec)} (lock {path}).",
                            f"If that run has ended, delete {path}; otherwise choose another output_dir.")
    finally:
        os.close(fd)


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError) as e:
        return isinstance(e, PermissionError)
    return True


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hold_for_launch(launcher, output_dir) -> RunLock | None:
    """The launching process's part: a launcher that runs the workers from here (local) takes the
    lock and tells the workers it holds it; one that submits a job (it has ``render``: Slurm) only
    checks that no live run holds it, and the job's rank 0 takes it when it starts."""
    if contracts.member(launcher, "launcher", "render") is not None:
        check_free(output_dir)
        return None
    lock = acquire(output_dir)
    os.environ[ENV] = str(lock.path)
    return lock


def hold_in_worker(output_dir) -> RunLock | None:
    """A worker's part: global rank 0 takes the lock unless the apiary parent that started it holds it."""
    if os.environ.get(ENV) or os.environ.get("RANK", "0") != "0":
        return None
    return acquire(output_dir)
