"""Process lifecycle of a multi-process run: signals in, exit codes out, no orphans.

``supervise(cmd)`` is how the ``train`` parent (and ``apiary launch launcher=local``) runs torchrun:

* torchrun starts in its own session, so a terminal's Ctrl-C reaches the parent only, and the
  parent forwards each signal once: SIGTERM, SIGINT and SIGUSR1 as they are (SIGHUP as SIGTERM).
  torchrun relays a signal it handles to every worker (``--signals-to-handle``), whose handler
  (framework/train/preempt/) checkpoints at the next step boundary and exits 75.
* A second SIGINT (Ctrl-C again) stops now: the parent sends SIGINT straight to the workers, which
  exit 130 at once without a checkpoint or a traceback; if anything of the run is still alive
  ``KILL_AFTER_S`` later, torchrun is killed (and with it the workers, below).
* The parent exits with the workers' code: each worker writes its exit code to a file in a folder
  the parent names (``APIARY_STATUS_DIR``); torchrun itself exits 1 when it shut its workers down
  for a signal, so its code alone cannot say whether they checkpointed.
* stdout's reader left (`train nproc=2 | head`): the parent, which watches the pipe its ranks write
  to (``reader_gone``), stops the run as it does on SIGTERM (the ranks, quiet on the closed pipe,
  checkpoint at the next step boundary and exit 75: framework/launch/pipes.py), and says so on
  stderr. It was: torchrun and the ranks killed at once, exit 141, the steps since the last save lost.
* No orphans: torchrun runs as ``python -m framework.launch.lifecycle torchrun`` (``torchrun_main``), which
  first asks for ``PR_SET_PDEATHSIG=SIGKILL`` (``die_with_parent``, checking that its parent is
  still the supervising pid), and every worker asks the same for itself, so killing the parent
  outright kills torchrun, which kills the workers, within milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from framework.errors import EXIT_DATA_TIMEOUT, EXIT_DISK_FULL, EXIT_NONFINITE, EXIT_PREEMPTED, EXIT_STOP_NOW, EXIT_USER_ERROR

STATUS_ENV = "APIARY_STATUS_DIR"
SUPERVISOR_ENV = "APIARY_SUPERVISOR_PID"  # torchrun_main: the parent it must die with
STDOUT_GONE = "stdout-gone"  # in the status folder: the parent's SIGTERM is for a closed stdout pipe
PREEMPT_EXIT_CODE = EXIT_PREEMPTED
# the codes a rank exits with after saying why in one paragraph (framework/errors.py)
APIARY_EXIT_CODES = (EXIT_USER_ERROR, EXIT_PREEMPTED, EXIT_NONFINITE, EXIT_DATA_TIMEOUT, EXIT_STOP_NOW, EXIT_DISK_FULL)
STOP_NOW_EXIT_CODE = EXIT_STOP_NOW
KILL_AFTER_S = 10.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux; False elsewhere).
    When the parent died before the request took effect (or is not ``expected_parent``), exit at once."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    if expected_parent is not None and parent != expected_parent:
        os._exit(STOP_NOW_EXIT_CODE)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(STOP_NOW_EXIT_CODE)
    return True


# ---------------------------------------------------------------- worker side
def write_status(code: int) -> None:
    """Worker: record this rank's exit code for the supervising parent (no-op without one)."""
    d = os.environ.get(STATUS_ENV)
    if not d:
        return
    try:
        (Path(d) / f"rank{os.environ.get('RANK', '0')}").write_text(str(int(code)))
    except OSError:
        pass


def stdout_gone_marked() -> bool:
    """Worker: whether the supervising parent's stop is for stdout's reader leaving (``STDOUT_GONE`` in the
    status folder), not for a signal: the rank says so in its stop line and summary."""
    d = os.environ.get(STATUS_ENV)
    return bool(d) and (Path(d) / STDOUT_GONE).exists()


def reader_gone(fd: int) -> bool:
    """Whether ``fd`` is the write end of a pipe whose reader has closed it (`| head` has exited: Linux's
    poll reports POLLERR for it); False for a terminal, a file, or anything that cannot be asked."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------- parent side
def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1] == str(pid):
            kids.append(int(d.name))
    return kids


def _say(msg: str) -> None:
    try:
        os.write(2, (msg + "\n").encode())
    except OSError:
        pass


def _exit_code(rc: int, status_dir: Path, signalled: int | None, stop_now: bool, nproc: int) -> int:
    codes = []
    for f in status_dir.glob("rank*"):
        try:
            codes.append(int(f.read_text().strip()))
        except (OSError, ValueError):
            pass
    if stop_now:
        return STOP_NOW_EXIT_CODE
    if codes and len(codes) >= nproc and all(c == PREEMPT_EXIT_CODE for c in codes):
        return PREEMPT_EXIT_CODE
    if rc == 0:
        return 0
    bad = [c for c in codes if c not in (0, PREEMPT_EXIT_CODE)]
    if bad:
        return bad[0]
    if signalled is not None:
        return 128 + int(signalled)
    return rc if rc > 0 else 128 - rc  # killed by a signal: shell convention


def supervise(cmd: list[str], env: dict | None = None, nproc: int = 1) -> int:
    """Run ``cmd`` (torchrun) as described in the module docstring; return the run's exit code."""
    status_dir = Path(tempfile.mkdtemp(prefix="apiary-status-"))
    env = dict(os.environ if env is None else env)
    env[STATUS_ENV] = str(status_dir)
    state = {"first": None, "stop_now": False, "stop_at": None}
    env[SUPERVISOR_ENV] = str(os.getpid())
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def workers() -> list[int]:
        return _children(proc.pid)

    def kill_all():
        for pid in workers():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()

    def handler(signum, frame):
        if proc.poll() is not None:
            return
        if state["first"] is None:
            state["first"] = signum
            fwd = signal.SIGTERM if signum in (signal.SIGHUP, signal.SIGPIPE) else signum
            again = " (Ctrl-C again to stop now, without a checkpoint)" if signum == signal.SIGINT else ""
            if signum == signal.SIGPIPE:  # not a signal here: `train nproc=N | head` has read its lines
                try:
                    (status_dir / STDOUT_GONE).touch()
                except OSError:
                    pass
                _say("apiary: stdout's reader left (a closed pipe: `| head`); the ranks checkpoint at the next step "
                     f"boundary and exit {PREEMPT_EXIT_CODE}, writing their files but no more console lines (Ctrl-C "
                     "to stop now, without a checkpoint)")
            else:
                _say(f"apiary: got {signal.Signals(signum).name}; the ranks checkpoint at the next step boundary "
                     f"and exit{again}")
            try:
                proc.send_signal(fwd)
            except OSError:
                pass
        elif signum == signal.SIGINT and not state["stop_now"]:
            state["stop_now"], state["stop_at"] = True, time.monotonic()
            _say("apiary: second SIGINT: stopping now, without a checkpoint")
            for pid in workers():
                try:
                    os.kill(pid, signal.SIGINT)
                except OSError:
                    pass

    previous = {s: signal.signal(s, handler) for s in FORWARDED}
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                # `train nproc=2 | head`: nothing more will be read: a stop as on SIGTERM (checkpoint, 75);
                # a stop already asked for (Ctrl-C on `train | tee log` ends tee too) goes on as it is
                if state["first"] is None and reader_gone(1):
                    handler(signal.SIGPIPE, None)
                    continue
                if state["stop_now"] and time.monotonic() - state["stop_at"] > KILL_AFTER_S:
                    _say("apiary: the ranks did not stop; killing them")
                    kill_all()
                    state["stop_at"] = float("inf")
        return _exit_code(rc, status_dir, state["first"], state["stop_now"], nproc)
    finally:
        for s, prev in previous.items():
            signal.signal(s, prev)
        if proc.poll() is None:  # an exception in this process: take the run down with it
            proc.kill()
        shutil.rmtree(status_dir, ignore_errors=True)


def torchrun_main(argv: list[str]) -> int:
    """``python -m framework.launch.lifecycle torchrun ARGS``: torchrun, without the SignalException
    traceback it prints after it has relayed a stop signal to its ranks (exit 128 + signal)."""
    supervisor = os.environ.pop(SUPERVISOR_ENV, None)
    if supervisor:  # the parent may be killed while this process starts
        die_with_parent(expected_parent=int(supervisor))

    from torch.distributed.elastic.multiprocessing.api import SignalException  # reason: start-up time (torch)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # reason: as above
    from torch.distributed.run import main as torchrun  # reason: start-up time (torch)

    try:
        torchrun(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:  # ranks that stopped with one of apiary's codes (a user error, a stop on
        # request, a non-finite loss, a data timeout) said why in one paragraph: no torchrun traceback of
        # their error files after it. < 0: a rank torchrun then stopped by signal. The first rank's code.
        failures = sorted(e.failures.values(), key=lambda f: f.timestamp)
        codes = [f.exitcode for f in failures if f.exitcode >= 0]
        if codes and all(c in APIARY_EXIT_CODES for c in codes):
            return codes[0]
        raise
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["torchrun"]:
        sys.exit(torchrun_main(sys.argv[2:]))
    sys.exit(f"usage: python -m framework.launch.lifecycle torchrun ARGS (got {sys.argv[1:]})")
