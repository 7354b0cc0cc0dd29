"""Preemption: a signal asks training to checkpoint at the next step boundary and exit.

``arm()`` installs a SIGUSR1/SIGTERM/SIGINT/SIGHUP handler that sets a flag (before any trainer is hooked,
there is nothing to save: it exits at once with ``EXIT_CODE``). A second SIGINT (Ctrl-C again,
more than ``SAME_DELIVERY_S`` after the first) stops the process at once with code 130, without
a checkpoint or a traceback. Under a supervising ``train`` parent each rank also writes its exit
code for the parent (framework/launch/lifecycle.py). ``install(trainer)`` wraps
the trainer's ``should_continue_training`` (on the instance): at every step boundary the flag is
all-reduced (MAX) over all ranks, so when ANY rank was signalled every rank stops after the same
step. The stopping ranks save a full, resumable checkpoint of that step (unless the step's regular
save already wrote it) and wait until it is complete as ``step-N`` (manifest written, folder renamed:
framework/train/integrity.py) before saying it was saved, then the loop ends normally. SIGHUP (a closed
terminal) is a stop request like SIGTERM, as the supervising parent of an nproc > 1 run treats it.
The worker then exits with ``EXIT_CODE`` (75, EX_TEMPFAIL: "try again"), which the Slurm script
reads as "requeue me".

Two ways in:
* ``python -m framework.train.preempt train ARGS`` (the Slurm template's worker command) arms the
  handlers before anything else, hooks every torchtitan Trainer this process trains, runs
  ``train ARGS`` and exits with ``EXIT_CODE`` when training stopped for a signal;
* framework/train/run.py: ``guard = preempt.install(trainer)`` after the Trainer is built and
  ``preempt.exit_if_stopped(guard)`` after it is closed (see docs/launching.md).
Both may be active at once: ``install`` hooks a trainer only once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field

from framework import compat
from framework.errors import EXIT_PREEMPTED, EXIT_STOP_NOW
from framework.launch import lifecycle
from framework.train import atomic_save

EXIT_CODE = EXIT_PREEMPTED  # stopped on request with a checkpoint; run it again
STOP_NOW_EXIT_CODE = EXIT_STOP_NOW  # a second SIGINT: stop at once, no checkpoint
SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SAME_DELIVERY_S = 0.3  # a SIGINT this soon after the first is the same one relayed twice (srun + torchrun)


@dataclass
class _Flag:
    signum: int | None = None
    at: float | None = None
    previous: dict = field(default_factory=dict)


_FLAG = _Flag()
_GUARDS: list["Guard"] = []


def _handler(signum, frame) -> None:
    first = _FLAG.signum is None
    rank, name = os.environ.get("RANK", "0"), signal.Signals(signum).name
    if not first and signum == signal.SIGINT and time.time() - _FLAG.at > SAME_DELIVERY_S:
        # Ctrl-C again: stop now. os._exit: no traceback, no waiting on a collective or a save.
        lifecycle.write_status(STOP_NOW_EXIT_CODE)
        done = [g.stopped_at for g in _GUARDS if g.saved and g.stopped_at is not None]
        what = (f"without a further checkpoint (step-{done[-1]} is complete)" if done else
                "without a checkpoint")
        os.write(2, f"apiary: rank {rank}: second SIGINT; stopping now {what} (exit "
                    f"{STOP_NOW_EXIT_CODE})\n".encode())
        os._exit(STOP_NOW_EXIT_CODE)
    pipe = signum == signal.SIGTERM and lifecycle.stdout_gone_marked()  # the parent's stop for a closed stdout
    if first:
        _FLAG.signum, _FLAG.at = (signal.SIGPIPE if pipe else signum), time.time()
    if not _GUARDS:  # no training loop yet: nothing to checkpoint, so stop now and ask to be rerun
        lifecycle.write_status(EXIT_CODE)
        os.write(2, f"apiary: rank {rank}: got {name} before training started; exiting with code "
                    f"{EXIT_CODE}\n".encode())
        raise SystemExit(EXIT_CODE)
    if first and not pipe:  # os.write: safe inside a signal handler (print may hold the stream's lock)
        again = " (Ctrl-C again to stop now)" if signum == signal.SIGINT and rank == "0" else ""
        os.write(2, f"apiary: rank {rank}: got {name}; checkpointing at the next step boundary{again}\n".encode())


def arm(signals=SIGNALS) -> bool:
    """Install the flag-setting handler (main thread only; returns False elsewhere)."""
    try:
        for s in signals:
            prev = signal.signal(s, _handler)
            if prev is not _handler:
                _FLAG.previous.setdefault(s, prev)
    except ValueError:  # not the main thread
        return False
    return True


def disarm() -> None:
    """Restore the handlers ``arm`` replaced."""
    for s, prev in _FLAG.previous.items():
        try:
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        except ValueError:
            pass
    _FLAG.previous.clear()


def requested() -> bool:
    """Whether this process received a preemption signal."""
    return _FLAG.signum is not None


def request(signum: int = signal.SIGUSR1) -> None:
    """Ask for a stop as a signal would (tests, or an in-process watchdog); like the signal, it
    raises SystemExit(EXIT_CODE) when no trainer is hooked yet."""
    _handler(signum, None)


def stop_for_closed_pipe() -> bool:
    """stdout's reader left (`train | head -3`; framework/launch/pipes.py): while a training loop is hooked
    in this process, a stop request as SIGTERM's (a checkpoint at the next step boundary, summary.json,
    exit 75), said once on stderr (silenced too when it is the same pipe); any thread may call it. False
    when no trainer is hooked: nothing to save, so the caller ends the command quietly (141)."""
    if not _GUARDS:
        return False
    if _FLAG.signum is None:
        _FLAG.signum, _FLAG.at = signal.SIGPIPE, time.time()
        try:
            os.write(2, f"apiary: rank {os.environ.get('RANK', '0')}: stdout's reader left (a closed pipe: `| head`); "
                        f"checkpointing at the next step boundary and exiting with code {EXIT_CODE}; metrics.jsonl "
                        "and summary.json are still written, the console lines no more (Ctrl-C to stop now, "
                        "without a checkpoint)\n".encode())
        except OSError:
            pass
    return True


def stdout_gone() -> bool:
    """Whether this process stops because stdout's reader left (``stop_for_closed_pipe``)."""
    return _FLAG.signum == signal.SIGPIPE


def stop_reason() -> str:
    """Why this process stopped on request, for its summary."""
    return "because stdout's reader left (a closed pipe)" if stdout_gone() else "by a signal"


def reset() -> None:
    _FLAG.signum = _FLAG.at = None
    _GUARDS.clear()


@dataclass
class Guard:
    """One trainer's preemption hook; ``stopped_at`` is the step it stopped after, or None."""

    trainer: object
    check_every: int = 1
    stopped_at: int | None = None
    saved: bool = False
    start_step: int | None = None
    last_saved: int | None = None
    _group: object = None
    _group_ready: bool = False

    # -- the collective decision ------------------------------------------------------
    def _agree(self) -> bool:
        """True on every rank when any rank was signalled (one small all-reduce)."""
        import torch  # reason: start-up time (`train` arms the handlers before torch loads)
        import torch.distributed as dist  # reason: as above

        from framework import devices  # reason: as above (it imports torch)

        mine = 1 if requested() else 0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return bool(mine)
        if not self._group_ready:
            self._group, self._group_ready = _cpu_group(), True
        if self._group is not None:
            t = torch.tensor([mine], dtype=torch.int32)
        else:  # default group (NCCL): the flag travels as a device tensor

            t = torch.tensor([mine], dtype=torch.int32, device=devices.device_type())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(int(t.item()))

    def should_stop(self) -> bool:
        step = int(self.trainer.step)
        if self.start_step is None:
            self.start_step = step
        if self.check_every > 1 and (step - self.start_step) % self.check_every:
            return False
        return self._agree()

    # -- stopping ---------------------------------------------------------------------
    def stop(self) -> None:
        t = self.trainer
        step = int(t.step)
        ck = getattr(t, "checkpointer", None)
        rank = os.environ.get("RANK", "0")
        if ck is None or not getattr(ck, "enable", False):
            note = "checkpointing is off: a rerun starts over"
        elif step == 0:  # a fresh run: nothing to start from, nothing to save (a resume is refused)
            note = "no checkpoint was written (no step trained): run it again without checkpoint.resume"
        elif step == self.start_step:
            note = f"no step trained since start (step {step}); the checkpoint it started from stays"
        elif self.last_saved == step:  # the interval's save: complete once renamed to step-N
            self.saved = complete(ck, step)
            note = (f"checkpoint step-{step} already written this step" if self.saved
                    else f"checkpoint step-{step} NOT saved")
        else:
            self.saved = force_save(ck, step)
            note = f"checkpoint step-{step} saved" if self.saved else f"checkpoint step-{step} NOT saved"
        self.stopped_at = step
        name = ("stdout's reader left" if _FLAG.signum == signal.SIGPIPE else
                signal.Signals(_FLAG.signum).name if _FLAG.signum else "a signal on another rank")
        print(f"apiary: rank {rank}: preempted ({name}) after step {step}; {note}; exiting with code "
              f"{EXIT_CODE} to be run again", file=sys.stderr, flush=True)


def _cpu_group():
    """A gloo group for the flag, so the per-step check never waits on the GPU stream."""
    import torch.distributed as dist  # reason: `python -m framework.train.preempt` arms the handlers before torch loads

    if "gloo" in str(dist.get_backend()):  # gloo, or "cuda:nccl,cpu:gloo": CPU tensors go through gloo
        return dist.group.WORLD
    try:
        return dist.new_group(backend="gloo")
    except Exception:  # gloo unavailable: fall back to the default group
        return None


def complete(ck, step: int) -> bool:
    """Whether the save of ``step`` is complete on disk (every rank calls it together): with apiary's
    atomic save, after waiting for its manifest and its rename to step-N; else as the save said."""
    done = atomic_save.complete_save(ck, step)
    return True if done is None else done


def force_save(ck, step: int) -> bool:
    """A full (resumable) checkpoint of ``step`` off the interval: same path, same async mode. True
    only once it is complete on disk (``step-N``, never a ``.partial-N`` a stop now would leave)."""
    ck.maybe_wait_for_saving()
    interval = getattr(ck, "interval", None)
    try:
        if interval is not None:
            ck.interval = 1  # every step is "on the interval" for this one call
        saved = ck.save(step, last_step=False)
    finally:
        if interval is not None:
            ck.interval = interval
    ck.maybe_wait_for_saving()  # an async save must land before the process exits
    return complete(ck, step) and bool(saved)


def install(trainer, *, check_every: int = 1, signals=SIGNALS) -> Guard:
    """Hook ``trainer`` (a built torchtitan Trainer with the member ``preempt_guard``, ApiaryTrainer's:
    the guard, once hooked): every rank must call this, in the same order."""
    existing = trainer.preempt_guard
    if existing is not None:
        return existing
    arm(signals)
    guard = Guard(trainer=trainer, check_every=max(1, int(check_every)))
    def should_continue_training(original_continue) -> bool:
        if not original_continue():
            return False
        if guard.stopped_at is None and guard.should_stop():
            guard.stop()
        return guard.stopped_at is None

    compat.gate_training_loop(trainer, should_continue_training)
    ck = getattr(trainer, "checkpointer", None)
    if ck is not None:
        def saved(curr_step, written):
            if written:
                guard.last_saved = int(curr_step)

        compat.observe_checkpoint_saves(ck, saved)
    trainer.preempt_guard = guard
    _GUARDS.append(guard)
    return guard


def stopped(guard: Guard | None = None) -> bool:
    """Whether ``guard`` (default: any trainer hooked in this process) stopped for a signal."""
    guards = [guard] if guard is not None else _GUARDS
    return any(g is not None and g.stopped_at is not None for g in guards)


def exit_if_stopped(guard: Guard | None = None) -> None:
    """After the trainer is closed: exit with EXIT_CODE when it stopped for a signal."""
    if stopped(guard):
        lifecycle.write_status(EXIT_CODE)
        raise SystemExit(EXIT_CODE)


def _hook_trainer_class() -> None:
    """Hook every torchtitan Trainer when its train() starts (used by ``main``; torchtitan is
    imported by compat after arm())."""
    compat.hook_trainer_train(install)
