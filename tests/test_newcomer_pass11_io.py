"""Newcomer pass 11 (docs/newcomer_eleventh_pass.md #5, #36, #37, #48): a closed stdout pipe, a full disk while a
checkpoint is written and at launch, and `apiary export` of a run that stopped before its first save."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.errors import EXIT_DISK_FULL, EXIT_PREEMPTED, EXIT_USER_ERROR

from conftest import _child_env, read_metrics, train_here


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


# ---------------------------------------------------------------- #5: `train | head -3`
def test_a_closed_stdout_stops_a_training_run_as_sigterm_does(tmp_path):
    """`train output_dir=... training.steps=6 | head -3` (was: 141 at the next print: no checkpoint, no summary.json,
    no message): the run checkpoints at the next step boundary, writes summary.json, says why on stderr (which
    still reaches the user, with the resume command) and exits 75."""
    run = tmp_path / "pipe"
    p = subprocess.Popen([sys.executable, "-m", "framework.cli", "train", f"output_dir={run}", "training.steps=40",
                          "checkpoint.interval=100"], cwd=tmp_path, env=_child_env({"OMP_NUM_THREADS": "1"}),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    assert first.startswith(b"apiary debug_moe"), first
    for _ in range(5):  # the data line, then the first step's: `| head -3`
        line = p.stdout.readline()
        assert line, "the run ended before its first step line"
        if line.startswith(b"step "):
            break
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(timeout=300)
    assert p.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "stdout's reader left" in err and "Traceback" not in err, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    step = summary["step"]
    assert summary["exit_code"] == EXIT_PREEMPTED and "stdout's reader left" in summary["stop"], summary
    assert 1 <= step < 40 and (run / "checkpoint" / f"step-{step}" / "manifest.json").is_file(), summary
    assert read_metrics(run)[-1]["step"] == step  # nothing trained past the saved step
    assert "checkpoint.resume=true" in err  # the summary, on stderr: stdout is gone


def test_the_supervisor_stops_its_ranks_as_on_sigterm_when_its_output_pipe_closes(tmp_path):
    """`train nproc=2 | head -3` (was: torchrun and the ranks killed within 0.5 s, exit 141, the steps since the last save
    lost): the parent sends the stop the ranks checkpoint on, marks it as a closed pipe for their stop lines and summary,
    says so on stderr, and exits with the ranks' 75."""
    from framework.launch.lifecycle import STATUS_ENV, STDOUT_GONE

    done = tmp_path / "checkpointed"
    child = tmp_path / "child.py"  # a stand-in for torchrun: on SIGTERM it checkpoints (1 s) and exits 75
    child.write_text("import os, signal, sys, time\n"
                     "def stop(*_):\n    time.sleep(1)\n"
                     f"    gone = os.path.exists(os.path.join(os.environ[{STATUS_ENV!r}], {STDOUT_GONE!r}))\n"
                     f"    open({str(done)!r}, 'w').write('pipe' if gone else 'signal')\n"
                     f"    open(os.path.join(os.environ[{STATUS_ENV!r}], 'rank0'), 'w').write('{EXIT_PREEMPTED}')\n"
                     f"    sys.exit({EXIT_PREEMPTED})\n"
                     "signal.signal(signal.SIGTERM, stop)\nprint('step 1', flush=True)\ntime.sleep(60)\n")
    code = ("import sys\nfrom framework.launch.lifecycle import supervise\n"
            f"sys.exit(supervise([sys.executable, {str(child)!r}]))\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=_child_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert p.returncode == EXIT_PREEMPTED and done.read_text() == "pipe", (p.returncode, err)
    assert "stdout's reader left" in err and "checkpoint" in err, err


def test_a_closed_pipe_stops_a_hooked_training_loop_and_nothing_else(monkeypatch):
    """preempt.stop_for_closed_pipe: with a trainer hooked, a stop request as SIGTERM's (flagged as the pipe's, so the
    stop line and summary say so); before any trainer is hooked, nothing to save: False (the command ends quietly, 141)."""
    import signal

    from framework.train import preempt

    preempt.reset()
    try:
        assert preempt.stop_for_closed_pipe() is False and not preempt.requested()
        monkeypatch.setattr(preempt, "_GUARDS", [object()])
        assert preempt.stop_for_closed_pipe() is True and preempt.requested() and preempt.stdout_gone()
        assert preempt._FLAG.signum == signal.SIGPIPE and "stdout's reader left" in preempt.stop_reason()
    finally:
        preempt.reset()


# ---------------------------------------------------------------- #36: a full disk while a checkpoint is written
def _fill_the_disk_at(monkeypatch, step: int, *, chained: bool = True, free: int = 0):
    """The save of ``step`` meets a full disk as torch.save does on one: it writes part of the file, then raises
    ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos`` (its OSError(ENOSPC) as the
    context, or, as another rank's error arrives pickled, none); the disk then has ``free`` bytes free."""
    from framework.resolve import disk
    from framework.train import atomic_save

    real = atomic_save.compat.wrap_checkpoint_saves
    full = {"on": False}

    def wrap(checkpointer, dcp_save, save):
        own_dcp, own_save = real(checkpointer, dcp_save, save)

        def failing(state_dict, checkpoint_id, *a, **k):
            if not checkpoint_id.endswith(f"{atomic_save.integrity.PARTIAL}{step}"):
                return own_dcp(state_dict, checkpoint_id, *a, **k)
            Path(checkpoint_id, "__0_0.distcp").write_bytes(b"\0" * 4096)  # half written
            full["on"] = True
            err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            if chained:
                err.__context__ = _enospc()
            raise err
        return failing, own_save

    real_room = disk.room
    monkeypatch.setattr(atomic_save.compat, "wrap_checkpoint_saves", wrap)
    monkeypatch.setattr(disk, "room", lambda path: (free, 2**21, Path("/")) if full["on"] else real_room(path))


@pytest.mark.parametrize("chained", [True, False], ids=["errno in the chain", "free space only"])
def test_a_full_disk_while_a_checkpoint_is_written_is_one_paragraph(workdir, capsys, monkeypatch, one_thread, chained):
    """Was: exit 1, a 105-line traceback ending in torch.save's `unexpected pos 704 vs 598`, no summary, and
    `checkpoint/.partial-4` left behind. Now: 74 and one paragraph naming the folder, the free space, the size of a
    checkpoint of this run, what is kept (step-2, metrics.jsonl) and what to do; the half-written save removed; the
    summary written."""
    _fill_the_disk_at(monkeypatch, 4, chained=chained)
    r = train_here(["train", "training.steps=6", "checkpoint.interval=2", "output_dir=run"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == EXIT_DISK_FULL, err[-3000:]
    assert "Traceback" not in err and "unexpected pos" not in err, err[-3000:]
    run = workdir / "run"
    assert f"output_dir=run: the disk is full{' (No space left on device)' if chained else ''}: saving checkpoint " \
           "step-4" in err, err
    assert "0 bytes free of 2.00 MiB" in err and "a checkpoint of this run takes" in err and "(step-2)" in err, err
    assert "kept: the complete checkpoint step-2, metrics.jsonl (steps 1-4)" in err, err
    assert "checkpoint/.partial-4 removed" in err and "checkpoint.resume=true" in err, err
    assert f"Exit code {EXIT_DISK_FULL}" in err
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-2"]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stop"], summary["exit_code"], summary["step"]) == ("on a full disk", EXIT_DISK_FULL, 4), summary
    assert summary["checkpoint"].endswith("step-2") and "resume" in summary["next"]


def test_a_full_disk_at_the_first_save_says_there_is_nothing_to_resume(workdir, capsys, monkeypatch, one_thread):
    _fill_the_disk_at(monkeypatch, 2)
    r = train_here(["train", "training.steps=4", "checkpoint.interval=2", "output_dir=run"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == EXIT_DISK_FULL, err[-3000:]
    assert "more than the 4.00 KiB of it written by then" in err and "no complete checkpoint" in err, err
    assert "nothing to resume" in err and not any((workdir / "run" / "checkpoint").iterdir()), err


def test_another_write_on_a_full_disk_is_the_same_paragraph(workdir, capsys, monkeypatch, one_thread):
    """metrics.jsonl's append (or a manifest) raising ENOSPC: the same paragraph and 74, not a traceback."""
    from framework.report import metrics

    real = metrics.JsonlLogger.log

    def log(self, m, step):
        if step == 3:
            raise _enospc()
        return real(self, m, step)

    monkeypatch.setattr(metrics.JsonlLogger, "log", log)
    r = train_here(["train", "training.steps=6", "checkpoint.interval=2", "output_dir=run"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == EXIT_DISK_FULL and "Traceback" not in err, err[-3000:]
    assert "the disk is full (No space left on device): writing the run's files failed" in err, err
    assert "kept: the complete checkpoint step-2, metrics.jsonl (steps 1-2)" in err, err


# ---------------------------------------------------------------- #37: a full disk at launch
def test_a_full_disk_at_launch_is_refused_before_anything_starts(workdir, capsys, monkeypatch):
    """Was: exit 1, runlock.py's `OSError: [Errno 28] No space left on device` traceback. Now exit 2, one paragraph,
    as for a read-only folder, and no run folder (nor lock) left."""
    import tempfile

    real = tempfile.TemporaryDirectory

    class Full(real):
        def __init__(self, *a, **k):
            raise _enospc()

    monkeypatch.setattr(tempfile, "TemporaryDirectory", Full)
    r = train_here(["train", "training.steps=2", "output_dir=run2"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == EXIT_USER_ERROR, err
    assert "output_dir=run2: the disk is full (No space left on device): the disk of" in err and "free of" in err, err
    assert "point output_dir at another disk" in err and "Traceback" not in err, err
    assert not (workdir / "run2").exists()


def test_a_lock_record_that_does_not_fit_is_refused_and_left_behind_nowhere(tmp_path, monkeypatch):
    """The disk filled between the probe and the lock (runlock.acquire's write: was the traceback of #37)."""
    from framework.errors import UserError
    from framework.launch import runlock

    real = runlock.os.write
    monkeypatch.setattr(runlock.os, "write", lambda fd, data: (_ for _ in ()).throw(_enospc()))
    with pytest.raises(UserError) as e:
        runlock.acquire(tmp_path / "run")
    monkeypatch.setattr(runlock.os, "write", real)
    assert "the disk is full (No space left on device)" in str(e.value) and e.value.exit_code == EXIT_USER_ERROR
    assert not (tmp_path / "run" / runlock.LOCK_NAME).exists()


def test_a_nearly_full_disk_is_refused_at_launch(workdir, capsys, monkeypatch):
    from framework.resolve import disk

    monkeypatch.setattr(disk, "room", lambda path: (600 * 1024, 2**23, Path("/")))
    r = train_here(["train", "training.steps=2", "output_dir=run2"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == EXIT_USER_ERROR and "the disk is nearly full" in err and "600.00 KiB free" in err, err


def test_a_disk_with_less_room_than_a_checkpoint_is_warned_about_at_launch(workdir, capsys, monkeypatch):
    from framework.launch import start
    from framework.resolve import disk

    monkeypatch.setattr(disk, "room", lambda path: (2 * 2**20, 2**23, Path("/")))
    assert start.launch(None, ["training.steps=2", "output_dir=run2"], dry_run=True) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "output_dir=run2: the disk of" in err and "2.00 MiB free" in err, err
    assert "one checkpoint of this run takes about" in err and "(exit 74)" in err, err


# ---------------------------------------------------------------- #48: export of a run that saved no step
def _stopped_before_its_first_save(run: Path, summary: dict | None) -> None:
    run.mkdir()
    (run / "config.yaml").write_text("recipe: debug_moe\ntraining:\n  steps: 6\ncheckpoint:\n  enable: true\n"
                                     "  interval: 10\nmodel:\n  family: qwen3\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in (1, 2)))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))


@pytest.mark.parametrize("summary, how", [
    (None, "stopped without a summary (killed, or it crashed"),
    ({"stop": "because stdout's reader left (a closed pipe)"}, "stopped because stdout's reader left"),
])
def test_export_of_a_run_that_stopped_before_its_first_save_says_so(tmp_path, summary, how):
    """`apiary export RUN` (was: "Train with checkpoint.enable=true first", though checkpointing was on)."""
    run = tmp_path / "run"
    _stopped_before_its_first_save(run, summary)
    r = subprocess.run([sys.executable, "-m", "toolkit.cli", "export", str(run), "--hf", str(tmp_path / "hf")],
                       cwd=tmp_path, env=_child_env(), capture_output=True, text=True, timeout=120)
    err = " ".join(r.stderr.split())
    assert r.returncode == EXIT_USER_ERROR, err
    assert "checkpoint.enable=true first" not in err and "no step was saved: checkpointing was on" in err, err
    assert f"{how}" in err and "after step 2, before its first save at step 6" in err, err
    assert "nothing to export or resume" in err and "lower checkpoint.interval" in err, err


def test_export_of_a_run_without_checkpointing_says_so(tmp_path):
    from framework.report import no_step

    run = tmp_path / "run"
    _stopped_before_its_first_save(run, None)
    (run / "config.yaml").write_text("training:\n  steps: 6\ncheckpoint:\n  enable: false\n  interval: 10\n")
    reason, fix = no_step.why(run)
    assert "checkpoint.enable=false" in reason and "checkpointing on" in fix
