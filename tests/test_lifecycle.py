"""Process lifecycle of a run: signals to the `train` parent (nproc=2 through torchrun, and nproc=1
in-process) checkpoint and exit 75, a parent killed outright leaves no worker behind, one writer per
output_dir (run.lock), and one metrics record per step after a resume."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.train import integrity

from conftest import ROOT, run_cli, train_here

TRAIN = ["recipe=debug_moe", "logging.tensorboard=false"]


# 30-60 s each on 2 CPU cores: opt-in with `pytest -m slow` (the SIGTERM case runs by default)
slow = pytest.mark.slow


# ----------------------------------------------------------------------------- helpers
def _env() -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT", "APIARY_RUN_LOCK",
              "APIARY_STATUS_DIR", "SLURM_JOB_ID"):
        e.pop(k, None)
    return e


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_leftovers():
    """A failing test takes its run down (the parent's death takes torchrun and the ranks along)."""
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()


def _start(argv: list[str], cwd: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "framework.cli", "train", *argv], cwd=cwd, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _STARTED.append(p)
    return p


def _steps(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    if not f.is_file():
        return []
    return [json.loads(line)["step"] for line in f.read_text().splitlines() if line.strip()]


def _wait_for_steps(proc: subprocess.Popen, run: Path, n: int, timeout: float = 150) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if len(_steps(run)) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (code {proc.returncode}) before step {n}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no step {n} within {timeout} s:\n{proc.stdout.read()[-4000:]}")


def _alive(needle: str) -> list[str]:
    """Processes (other than this one) whose command line names ``needle``: a /proc scan."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            found.append(f"{d.name}: {cmd[:200]}")
    return found


def _none_alive_within(needle: str, seconds: float = 10) -> list[str]:
    end = time.time() + seconds
    while (left := _alive(needle)) and time.time() < end:
        time.sleep(0.25)
    return left


def _signal_run(tmp_path, sig: int, nproc: int, extra=()):
    """Start a long run, signal the parent after step 2, return (exit code, output, run dir)."""
    run = tmp_path / f"run-{signal.Signals(sig).name}-{nproc}"
    proc = _start([*TRAIN, f"nproc={nproc}", "training.steps=400", "checkpoint.interval=200",
                   f"output_dir={run}", *extra], tmp_path)
    _wait_for_steps(proc, run, 2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, run


def _check_checkpointed(code: int, out: str, run: Path, nproc: int) -> int:
    assert code == 75, out[-4000:]
    saved = r"checkpoint step-\d+ (?:saved|already written this step)"
    stops = {int(k) for k in re.findall(rf"preempted \(\w+\) after step (\d+); {saved}", out)}
    assert len(stops) == 1, out[-4000:]  # every rank stopped after the same step
    k = stops.pop()
    assert len(re.findall(rf"after step {k}; {saved}", out)) == nproc, out[-4000:]
    assert (run / "checkpoint" / f"step-{k}" / ".metadata").is_file()
    assert _steps(run) == list(range(1, k + 1))
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    assert not (run / "run.lock").exists()  # released
    assert _none_alive_within(str(run)) == []
    return k


# ----------------------------------------------------------------------------- nproc=2: signals
def test_sigterm_to_the_parent_checkpoints_and_exits_75(tmp_path):
    """The representative case (default run): SIGTERM to `train nproc=2` reaches both ranks through
    torchrun; they checkpoint the same step and the parent exits 75; no process of the run is left.
    The parent holds the run's lock while it runs."""
    run = tmp_path / "run"
    proc = _start([*TRAIN, "nproc=2", "training.steps=400", "checkpoint.interval=200", f"output_dir={run}"],
                  tmp_path)
    _wait_for_steps(proc, run, 2)
    holder = json.loads((run / "run.lock").read_text())
    assert holder["pid"] == proc.pid and holder["host"] == socket.gethostname()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    k = _check_checkpointed(proc.returncode, out, run, nproc=2)
    assert k >= 2
    assert "apiary: got SIGTERM" in out


@slow
def test_sigint_to_the_parent_behaves_like_sigterm_and_resume_meanwhile_is_refused(tmp_path):
    """SIGINT (one Ctrl-C) = SIGTERM. While the run trains, `checkpoint.resume=true` on its
    directory exits 2 naming the holder (it would re-train the steps the first run is training)."""
    run = tmp_path / "run"
    proc = _start([*TRAIN, "nproc=2", "training.steps=400", "checkpoint.interval=2", f"output_dir={run}"], tmp_path)
    _wait_for_steps(proc, run, 2)
    end = time.time() + 60
    while not (run / "checkpoint" / "step-2" / ".metadata").is_file() and time.time() < end:
        time.sleep(0.2)
    second = run_cli(["train", *TRAIN, "checkpoint.resume=true", f"output_dir={run}", "training.steps=400"],
                     cwd=tmp_path, timeout=120)
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    msg = " ".join(second.stderr.split())
    assert f"is in use by pid {proc.pid} on host {socket.gethostname()}" in msg, msg
    assert "Traceback" not in second.stderr and "step " not in second.stdout
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    _check_checkpointed(proc.returncode, out, run, nproc=2)
    assert "Ctrl-C again to stop now" in out


@slow
def test_sigusr1_to_the_parent_checkpoints(tmp_path):
    code, out, run = _signal_run(tmp_path, signal.SIGUSR1, nproc=2)
    _check_checkpointed(code, out, run, nproc=2)


@slow
def test_sigkill_to_the_parent_leaves_no_worker(tmp_path):
    run = tmp_path / "run"
    proc = _start([*TRAIN, "nproc=2", "training.steps=400", "checkpoint.interval=200", f"output_dir={run}"],
                  tmp_path)
    _wait_for_steps(proc, run, 1)
    assert len(_alive(str(run))) >= 4  # parent, torchrun, 2 ranks
    proc.kill()
    proc.communicate(timeout=30)
    assert _none_alive_within(str(run), 10) == []
    # the lock it left is stale (its process is gone on this host): the next run takes it over
    from framework.launch import runlock

    warnings = []
    lock = runlock.acquire(run, warn=warnings.append)
    lock.release()
    assert len(warnings) == 1 and f"pid {proc.pid}" in warnings[0] and "is gone" in warnings[0], warnings


@slow
def test_second_ctrl_c_stops_now_without_traceback(tmp_path):
    run = tmp_path / "run"
    proc = _start([*TRAIN, "nproc=2", "training.steps=400", "checkpoint.interval=200", f"output_dir={run}"],
                  tmp_path)
    _wait_for_steps(proc, run, 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-4000:]
    assert "stopping now" in out and "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    assert _none_alive_within(str(run), 10) == []


# ----------------------------------------------------------------------------- nproc=1, in-process
@slow
def test_sigint_in_process_checkpoints_and_exits_75(tmp_path):
    code, out, run = _signal_run(tmp_path, signal.SIGINT, nproc=1)
    _check_checkpointed(code, out, run, nproc=1)


@slow
def test_sighup_in_process_checkpoints_and_exits_75(tmp_path):
    """A closed terminal with nproc=1 (was: exit 129, no checkpoint, no message; nproc=2's parent
    forwards it as SIGTERM)."""
    code, out, run = _signal_run(tmp_path, signal.SIGHUP, nproc=1)
    _check_checkpointed(code, out, run, nproc=1)
    assert "got SIGHUP; checkpointing at the next step boundary" in out, out[-4000:]


@slow
def test_second_ctrl_c_in_process_claims_no_checkpoint_it_did_not_complete(tmp_path):
    """Two SIGINTs 1 s apart, nproc=1 (was: "checkpoint step-6 saved" with only .partial-6 on disk):
    a step said to be saved is complete; the second SIGINT stops without a traceback."""
    run = tmp_path / "run"
    proc = _start([*TRAIN, "nproc=1", "training.steps=400", "checkpoint.interval=200", f"output_dir={run}"],
                  tmp_path)
    _wait_for_steps(proc, run, 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode in (75, 130), out[-4000:]
    claimed = {int(n) for n in re.findall(r"checkpoint step-(\d+) (?:saved|already written)", out)}
    assert claimed <= set(integrity.complete_steps(run / "checkpoint")), out[-4000:]
    if proc.returncode == 130:
        assert "stopping now" in out, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]


@slow
def test_sigterm_one_process_then_resume_reproduces_the_uninterrupted_losses(tmp_path):
    """A constant learning rate after warm-up (lr.min_lr_factor=1), so that runs of different
    training.steps share one schedule."""
    const = "lr.min_lr_factor=1.0"
    code, out, run = _signal_run(tmp_path, signal.SIGTERM, nproc=1, extra=[const])
    k = _check_checkpointed(code, out, run, nproc=1)
    total = k + 3
    p = run_cli(["train", *TRAIN, "checkpoint.resume=true", f"output_dir={run}", f"training.steps={total}",
                 "checkpoint.interval=200", const], cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = tmp_path / "uninterrupted"
    p = run_cli(["train", *TRAIN, f"output_dir={ref}", f"training.steps={total}", "checkpoint.interval=200",
                 const], cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert _steps(run) == list(range(1, total + 1))
    assert losses == [json.loads(x)["loss"] for x in (ref / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- the run lock
_HOLD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from framework.launch import runlock
lock = runlock.acquire(sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_a_locked_directory_exits_2_naming_the_holder(tmp_path):
    run = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(ROOT), str(run)], env=_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(p.name for p in run.iterdir())
        p = run_cli(["train", *TRAIN, f"output_dir={run}", "nproc=2"], cwd=tmp_path, timeout=120)
        assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
        msg = " ".join(p.stderr.split())
        assert f"output_dir={run}: is in use by pid {holder.pid} on host {socket.gethostname()}" in msg, msg
        assert "choose another output_dir" in msg and "Traceback" not in p.stderr
        assert sorted(x.name for x in run.iterdir()) == before  # nothing written, no worker started
        assert "torchrun" not in p.stdout + p.stderr
        p = run_cli(["apiary", "launch", *TRAIN, "launcher=local", "nproc=2", f"output_dir={run}"], cwd=tmp_path,
                    timeout=120)
        assert p.returncode == 2 and f"is in use by pid {holder.pid}" in " ".join(p.stderr.split()), p.stderr
        assert sorted(x.name for x in run.iterdir()) == before
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_is_taken_over_with_a_warning_and_foreign_ones_refused(tmp_path, monkeypatch):
    from framework.errors import UserError
    from framework.launch import runlock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rec = {"host": socket.gethostname(), "pid": dead.pid, "started": "earlier", "command": "train"}
    (tmp_path / "run.lock").write_text(json.dumps(rec))
    warnings = []
    lock = runlock.acquire(tmp_path, warn=warnings.append)
    assert lock.took_over["pid"] == dead.pid
    assert len(warnings) == 1 and f"pid {dead.pid}" in warnings[0] and "is gone" in warnings[0]
    held = json.loads((tmp_path / "run.lock").read_text())
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    with pytest.raises(UserError, match=f"in use by pid {os.getpid()}"):  # flock: held even in this process
        runlock.acquire(tmp_path)
    with pytest.raises(UserError, match="in use by"):
        runlock.check_free(tmp_path)
    lock.release()
    assert not (tmp_path / "run.lock").exists()
    runlock.check_free(tmp_path)
    runlock.acquire(tmp_path).release()  # a released lock is taken without a warning

    # a record from another host: its flock is not visible here, so it is refused ...
    other = {"host": "elsewhere-node-7", "pid": 4242, "started": "earlier", "slurm_job_id": "99"}
    (tmp_path / "run.lock").write_text(json.dumps(other))
    with pytest.raises(UserError, match="elsewhere-node-7") as e:
        runlock.acquire(tmp_path)
    assert f"delete {tmp_path / 'run.lock'}" in str(e.value)
    # ... unless it is this Slurm job's own earlier run (requeued onto another node)
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    warnings.clear()
    runlock.acquire(tmp_path, warn=warnings.append).release()
    assert "earlier run of this Slurm job 99" in warnings[0]


# ----------------------------------------------------------------------------- metrics after a resume
def test_supersede_moves_records_at_and_after_the_first_step(tmp_path):
    from framework.report.metrics import SUPERSEDED_NAME, supersede

    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    assert supersede(m, 5) == 4  # 5, 6, 7 and the line cut short
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [1, 2, 3, 4]
    moved = (tmp_path / SUPERSEDED_NAME).read_text().splitlines()
    assert [json.loads(x)["step"] for x in moved[:3]] == [5, 6, 7] and moved[3] == '{"step": 8, "lo'
    assert supersede(m, 5) == 0  # nothing more to move


def test_resume_after_a_crash_keeps_one_record_per_step(tmp_path, capsys):
    """A run that crashed after step 5 with its last checkpoint at step 3 (the state a kill -9 leaves):
    the resume re-trains 4..5; metrics.jsonl holds each step once and the earlier 4..5 are moved
    aside, with the same losses bit for bit."""
    run = tmp_path / "run"
    args = ["train", *TRAIN, "training.steps=5", "checkpoint.interval=3", f"output_dir={run}"]
    p = train_here(args, tmp_path, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    first = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    import shutil

    shutil.rmtree(run / "checkpoint" / "step-5")  # the crash came before step 5 was saved
    p = train_here([*args, "checkpoint.resume=true"], tmp_path, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 record(s) from step 4 on" in p.stdout
    now = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in now] == [1, 2, 3, 4, 5]
    old = [json.loads(x) for x in (run / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in old] == [4, 5]
    assert [r["loss"] for r in old] == [r["loss"] for r in first[3:]]
    assert [r["loss"] for r in now] == [r["loss"] for r in first]  # resume reproduces the losses


def test_shutdown_timeout_below_one_is_refused_before_anything(tmp_path, capsys, monkeypatch):
    from framework.cli import train_main

    monkeypatch.chdir(tmp_path)
    assert train_main([*TRAIN, "nproc=2", "launcher.shutdown_timeout_s=0", "output_dir=out"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "launcher.shutdown_timeout_s=0: must be >= 1" in err
    assert not (tmp_path / "out").exists()


def test_without_flock_the_record_decides(tmp_path, monkeypatch):
    """A file system without flock (ENOLCK): a live pid on this host holds the directory; a dead one
    is taken over; the run goes on with a warning rather than failing."""
    import errno

    from framework.errors import UserError
    from framework.launch import runlock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", no_flock)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
        with pytest.raises(UserError, match=f"in use by pid {holder.pid}"):
            runlock.acquire(tmp_path, warn=lambda m: None)
    finally:
        holder.kill()
        holder.wait()
    warnings = []
    runlock.acquire(tmp_path, warn=warnings.append).release()
    assert "without flock" in warnings[0] and f"pid {holder.pid}" in warnings[1] and "is gone" in warnings[1]
