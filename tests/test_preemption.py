"""The preemption hook (framework/train/preempt.py): SIGUSR1/SIGTERM mid-training checkpoints at the
next step boundary and exits 75 for a requeue; a signal on one rank stops every rank at the same
step. torchtitan's loop is stood in for by a fake trainer; the real one under Slurm is
tests/test_slurm.py::test_slurm_job_is_preempted_requeued_and_resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest

from framework.train import atomic_save, integrity

from conftest import ROOT, run_ranks


class _FakeCheckpointer:
    def __init__(self, interval):
        self.enable, self.interval, self.saved = True, interval, []

    def save(self, curr_step, last_step=False):
        if last_step or curr_step % self.interval == 0:
            self.saved.append(curr_step)
            return True
        return False

    def maybe_wait_for_saving(self):
        pass


class _FakeTrainer:
    """torchtitan's loop shape: should_continue_training / step / checkpointer.save."""

    def __init__(self, steps, interval, signal_at=None, sig=signal.SIGUSR1):
        self.step, self.steps, self.signal_at, self.sig = 0, steps, signal_at, sig
        self.preempt_guard = None  # ApiaryTrainer's member: preempt.install sets it
        self.checkpointer = _FakeCheckpointer(interval)

    def should_continue_training(self):
        return self.step < self.steps

    def train(self):
        while self.should_continue_training():
            self.step += 1
            if self.step == self.signal_at:
                os.kill(os.getpid(), self.sig)  # arrives mid-step
            self.checkpointer.save(self.step, last_step=self.step == self.steps)


@pytest.fixture
def preempt():
    from framework.train import preempt as p

    p.reset()
    yield p
    p.disarm()
    p.reset()


@pytest.mark.parametrize("interval,signal_at,saved", [(100, 3, [3]), (3, 3, [3]), (2, 3, [2, 3])])
def test_preempt_checkpoints_at_the_step_boundary(preempt, capsys, interval, signal_at, saved):
    t = _FakeTrainer(steps=10, interval=interval, signal_at=signal_at)
    guard = preempt.install(t)
    assert preempt.install(t) is guard  # hooks a trainer once
    t.train()
    assert guard.stopped_at == 3 and t.step == 3 and guard.saved
    assert t.checkpointer.saved == saved  # one checkpoint of step 3, never two
    assert "preempted (SIGUSR1) after step 3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        preempt.exit_if_stopped(guard)
    assert e.value.code == preempt.EXIT_CODE == 75


def test_sighup_checkpoints_like_sigterm(preempt, capfd):
    """A closed terminal (SIGHUP) with nproc=1 (was: exit 129, no checkpoint, no message; nproc=2's
    parent already forwarded it as SIGTERM)."""
    assert signal.SIGHUP in preempt.SIGNALS  # checked first: unhandled, SIGHUP would end the test process
    t = _FakeTrainer(steps=10, interval=100, signal_at=3, sig=signal.SIGHUP)
    guard = preempt.install(t)
    t.train()
    assert guard.stopped_at == 3 and guard.saved and t.checkpointer.saved == [3]
    err = capfd.readouterr().err  # the handler writes to fd 2 (os.write: safe in a signal handler)
    assert "got SIGHUP; checkpointing at the next step boundary" in err, err
    assert "preempted (SIGHUP) after step 3; checkpoint step-3 saved" in err, err
    with pytest.raises(SystemExit) as e:
        preempt.exit_if_stopped(guard)
    assert e.value.code == 75


class _AtomicCheckpointer(_FakeCheckpointer):
    """Saves through apiary's atomic save (framework/train/integrity.py): into .partial-N, hashed in the
    background, renamed to step-N at a later save or the trainer's close."""

    def __init__(self, folder, interval):
        super().__init__(interval)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True)
        atomic_save.install_atomic_save(self)

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"x" * 4096)
        Path(checkpoint_id, ".metadata").write_bytes(b"meta")

    def save(self, curr_step, last_step=False):
        from torchtitan.components.checkpoint import AsyncMode

        if last_step or curr_step % self.interval == 0:
            self.dcp_save({}, str(self.folder / f"step-{curr_step}"), AsyncMode.DISABLED)
            self.saved.append(curr_step)
            return True
        return False


@pytest.mark.parametrize("interval", [100, 3])  # the stop's own save; the interval's save of that step
def test_saved_is_said_only_once_the_step_is_complete(preempt, capsys, tmp_path, interval):
    """A second Ctrl-C right after the stop's message ends the process at once (os._exit), before the
    trainer's close would complete the last save; so the message waits for step-N (was: "checkpoint
    step-6 saved" with only .partial-6 on disk, and a resume found no checkpoint)."""
    t = _FakeTrainer(steps=10, interval=interval, signal_at=3)
    t.checkpointer = _AtomicCheckpointer(tmp_path / "checkpoint", interval)
    guard = preempt.install(t)
    t.train()
    err = capsys.readouterr().err
    assert guard.stopped_at == 3 and guard.saved and t.checkpointer.saved == [3]
    assert re.search(r"after step 3; checkpoint step-3 (saved|already written this step)", err), err
    # as a second Ctrl-C would leave it: nothing finished the save after the message
    ck = tmp_path / "checkpoint"
    assert integrity.complete_steps(ck) == [3] and integrity.verify(ck / "step-3") is None
    assert not list(ck.glob(".partial-*"))


def test_preempt_before_any_step_saves_nothing(preempt):
    t = _FakeTrainer(steps=5, interval=100)
    guard = preempt.install(t)
    preempt.request()
    t.train()
    assert guard.stopped_at == 0 and t.checkpointer.saved == [] and not guard.saved


def test_a_signal_before_training_exits_at_once(preempt):
    preempt.arm()
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)  # the handler runs at the next bytecode
    assert e.value.code == preempt.EXIT_CODE


def test_no_signal_trains_to_the_end(preempt):
    t = _FakeTrainer(steps=5, interval=100)
    guard = preempt.install(t)
    t.train()
    assert guard.stopped_at is None and t.step == 5 and t.checkpointer.saved == [5]
    preempt.exit_if_stopped(guard)  # no exit


_RANKS = textwrap.dedent("""
    import os, sys, json
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from test_preemption import _FakeTrainer
    from framework.train import preempt
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    class T(_FakeTrainer):
        def train(self):
            while self.should_continue_training():
                self.step += 1
                if rank == 1 and self.step == 4:
                    preempt.request()          # only rank 1 is signalled
                self.checkpointer.save(self.step, last_step=self.step == self.steps)
    t = T(steps=10, interval=100)
    g = preempt.install(t)
    t.train()
    # one file per rank: ranks share stdout, and two prints can land on one line
    with open(f"result-{rank}.json", "w") as f:
        json.dump({"rank": rank, "stopped_at": g.stopped_at, "saved": t.checkpointer.saved}, f)
    dist.barrier()  # tear gloo down together: a rank leaving early can abort its peer's exit
    dist.destroy_process_group()
    # the interpreter's own teardown still aborted a rank now and then under load ("terminate called without an
    # active exception", gloo's threads): what is checked is in the files above, and the product's ranks report
    # their exit code through lifecycle's status files for the same reason
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
""")


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    proc = run_ranks(script, [ROOT / "tests"], 2, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in (0, 1)
               if (tmp_path / f"result-{r}.json").exists()]
    assert [r["rank"] for r in results] == [0, 1], proc.stdout[-2000:]
    # rank 1 was signalled during step 4; both ranks stop after step 4 and both save step 4
    assert [r["stopped_at"] for r in results] == [4, 4]
    assert [r["saved"] for r in results] == [[4], [4]]
