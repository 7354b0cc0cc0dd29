"""Slurm launcher: the rendered script, preflight errors, and a real
single-node Slurm cluster (tests/harness/slurm_cluster.sh: root, installs slurm-wlm and munge with
apt where missing) running debug_moe on 2 CPU ranks through the generated script, preempted with
USR1, requeued and resumed to the end (the preemption hook itself: tests/test_preemption.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT

HARNESS = ROOT / "tests" / "harness" / "slurm_cluster.sh"
SLURM_DIR = Path(os.environ.get("SLURM_TEST_DIR", "/tmp/slurm-test"))  # the harness's folder
CANNOT_RUN = 3  # the harness's exit code when this machine cannot run a cluster (it says why)


def _launch(capsys, argv):
    from toolkit.launch import launch_main

    code = launch_main(argv)
    cap = capsys.readouterr()
    return code, cap.out, " ".join(cap.err.split())


# ----------------------------------------------------------------------------- script
def test_dry_run_renders_the_script(capsys, workdir):
    code, script, err = _launch(capsys, [
        "recipe=debug_moe", "launcher=slurm", "nodes=4", "gpus_per_node=8", "partition=gpu", "account=proj",
        "time=02:00:00", "qos=high", "training.steps=50", "--dry-run"])
    assert code == 0, err
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --qos=high",
                 "#SBATCH --time=02:00:00", "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append"]:
        assert line in script, line
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in script
    assert '--rdzv-backend=c10d' in script and '--rdzv-id="$SLURM_JOB_ID"' in script
    assert "--nproc-per-node=8" in script and "--tee=3" in script and "--log-dir=" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script and "trap on_usr1 USR1" in script
    assert "checkpoint.resume=true" in script  # added at run time when a checkpoint exists
    assert f"export PATH={Path(sys.executable).parent}:" in script
    for env in ("NCCL_NVLS_ENABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "PYTHONUNBUFFERED"):
        assert f"export {env}=" in script, env
    assert "APIARY_DEVICE=cpu" not in script
    out_dir = re.search(r"^OUTPUT_DIR=(\S+)$", script, re.M).group(1)
    assert Path(out_dir).is_absolute() and out_dir.startswith(str(workdir))
    # the workers get the recipe and overrides, never the launcher's own keys
    args = re.search(r"^TRAIN_ARGS=\((.*)\)$", script, re.M).group(1)
    assert "recipe=debug_moe" in args and "training.steps=50" in args and "launcher" not in args
    assert "dims {'dp_replicate': 1, 'dp_shard': 32" in script  # derived for 4 x 8 ranks
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert not (workdir / "runs").exists()  # a dry run writes nothing


def test_cpu_device_mode(capsys, workdir):
    code, script, err = _launch(capsys, ["launcher=slurm", "nodes=2", "gpus_per_node=2", "device=cpu",
                                         "cpus_per_task=4", "--dry-run"])
    assert code == 0, err
    assert "--gpus-per-node" not in script and "export APIARY_DEVICE=cpu" in script
    assert "#SBATCH --cpus-per-task=4" in script and "--nproc-per-node=2" in script


@pytest.mark.parametrize("argv,needles", [
    (["parallel.ep=3"], ["parallel.ep=3", "EP 3 must divide", "world size 8"]),
    (["parallel.dp_shard=4"], ["not the world size 8"]),
    (["checkpoint.load_path=/nonexistent/step-0"], ["checkpoint.load_path=/nonexistent/step-0", "does not exist"]),
    (["launcher.nodez=2"], ["unknown key 'launcher.nodez'", "launcher.nodes"]),
    (["nodes=0"], ["launcher.nodes=0", "must be >= 1"]),
    (["time=abc"], ["launcher.time=abc", "not a Slurm time limit"]),
    (["time=5", "preempt_signal_s=300"], ["preempt_signal_s=300", "before the time limit"]),
    (["template=/nonexistent.sbatch.j2"], ["no template file", "apiary cp-template slurm"]),
    (["device=tpu"], ["launcher.device=tpu", "gpu or cpu"]),
    (["recipe=debug_mo"], ["unknown recipe 'debug_mo'"]),
    (["checkpoint.resume=true", "output_dir=nowhere"], ["holds no checkpoint"]),
    (["--bogus"], ["unknown flag"]),
    (["nproc=4"], ["nproc is an option of launcher local", "gpus_per_node"]),
])
def test_preflight_errors(capsys, workdir, argv, needles):
    code, _, err = _launch(capsys, ["launcher=slurm", "nodes=1", "gpus_per_node=8", *argv, "--dry-run"])
    assert code == 2, err
    assert err.startswith("error apiary:") and "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    assert not (workdir / "runs").exists()


def test_dry_run_warns_of_inputs_missing_here(capsys, workdir):
    """A dry run renders the script though the data and tokenizer are not on this machine (they may
    be on the cluster's filesystem), warning for each; other errors still stop it."""
    argv = ["launcher=slurm", "nodes=1", "gpus_per_node=8", "data.path=/nonexistent/corpus.jsonl",
            "data.tokenizer=/nonexistent/tok", "--dry-run"]
    code, script, err = _launch(capsys, argv)
    assert code == 0 and "#SBATCH --nodes=1" in script, err
    for key in ("data.path=/nonexistent/corpus.jsonl", "data.tokenizer=/nonexistent/tok"):
        assert f"warning {key} does not exist on this machine; the job needs it where it runs" in err, err
    code, _, err = _launch(capsys, [*argv, "parallel.ep=3"])
    assert code == 2 and "EP 3 must divide" in err
    code, _, err = _launch(capsys, argv[:-1])  # a submission: refused before anything is written
    assert code == 2 and "data.tokenizer=/nonexistent/tok: no tokenizer folder" in err and not (workdir / "runs").exists()


def test_no_sbatch_is_a_user_error(capsys, workdir, monkeypatch):
    monkeypatch.setenv("PATH", str(workdir))  # no sbatch here
    code, _, err = _launch(capsys, ["launcher=slurm", "nodes=1", "gpus_per_node=2"])
    assert code == 2 and "sbatch is not on PATH" in err and "--dry-run" in err
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("said, check", [
    ("sbatch: error: invalid partition specified: gpu", "launcher.partition"),
    # newcomer pass 5's #31: no controller reachable (was: the partition/account advice of a refused job)
    ("sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host",
     "sbatch did not reach the Slurm controller: submit from a host of the cluster"),
])
def test_a_failing_sbatch_is_one_paragraph_naming_the_script(capsys, workdir, monkeypatch, said, check):
    """sbatch on PATH that refuses the job (was: exit 1 with sbatch's raw stderr, the run folder's script
    unmentioned): exit 2, sbatch's error line, the script to submit by hand and what to check."""
    import os

    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho '{said}' >&2\n"
                                   "echo 'sbatch: error: Batch job submission failed' >&2\n"
                                   "exit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    code, _, err = _launch(capsys, ["launcher=slurm", "nodes=1", "gpus_per_node=2", "output_dir=run"])
    text = " ".join(err.split())
    script = workdir / "run" / "train.sbatch"
    assert code == 2 and f"apiary: launcher=slurm: sbatch exited 1: {said}" in text, err
    assert f"sbatch {script}" in text and check in text and "Traceback" not in err
    assert ("launcher.partition" in text) == (check == "launcher.partition")
    assert script.exists() and (workdir / "run" / "resolved.yaml").exists()


def test_a_shorthand_of_another_launcher_names_it(capsys, workdir):
    code, _, err = _launch(capsys, ["nodes=4", "--dry-run"])  # the recipe's launcher is local
    assert code == 2 and "nodes is an option of launcher slurm" in err and "launcher=slurm" in err


def test_unregistered_launcher_is_a_user_error(capsys, workdir):
    code, _, err = _launch(capsys, ["launcher=slurmm", "--dry-run"])
    assert code == 2 and "unknown launcher 'slurmm'" in err


def test_cp_template_and_custom_template(capsys, workdir):
    from toolkit.launch import cp_template_main

    assert cp_template_main(["slurm", "my.sbatch.j2"]) == 0
    mine = workdir / "my.sbatch.j2"
    assert mine.read_text() == (ROOT / "launchers/slurm/train.sbatch.j2").read_text()
    assert cp_template_main(["slurm", "my.sbatch.j2"]) == 2  # never overwrites
    mine.write_text(mine.read_text().replace("set -uo pipefail", "set -uo pipefail\nmodule load site-stack  # mine"))
    capsys.readouterr()
    code, script, err = _launch(capsys, ["launcher=slurm", "gpus_per_node=2", "template=my.sbatch.j2", "--dry-run"])
    assert code == 0, err
    assert "module load site-stack  # mine" in script
    mine.write_text("#!/bin/bash\n{{ no_such_variable }}\n")
    code, _, err = _launch(capsys, ["launcher=slurm", "gpus_per_node=2", "template=my.sbatch.j2", "--dry-run"])
    assert code == 2 and "does not render" in err and "no_such_variable" in err


def test_local_launcher_dry_run(capsys, workdir, monkeypatch):
    """The dry run prints the very command the local launcher starts: the same launch, with
    framework.launch.lifecycle's supervise (which would start it) replaced by a recorder."""
    import shlex

    from framework.launch import lifecycle, runlock

    argv = ["launcher=local", "nproc=2", "training.steps=3", f"output_dir={workdir / 'runs' / 'a'}"]
    code, out, err = _launch(capsys, [*argv, "--dry-run"])
    assert code == 0, err
    assert not (workdir / "runs").exists()
    printed = shlex.split(out.strip())
    assert printed[:5] == [sys.executable, "-m", "framework.launch.lifecycle", "torchrun", "--standalone"], out
    assert "--nproc_per_node=2" in printed and printed[printed.index("train") - 2:][:2] == ["-m", "framework.cli"]
    assert "launcher.nproc=2" in printed and "dry run: nothing started." in err

    started = []
    monkeypatch.setattr(lifecycle, "supervise", lambda cmd, env, nproc: started.append(list(cmd)) or 0)
    monkeypatch.delenv(runlock.ENV, raising=False)
    code, out, err = _launch(capsys, argv)
    monkeypatch.delenv(runlock.ENV, raising=False)  # the launch holds the run's lock for its workers
    assert code == 0, err
    assert started == [printed]

    code, out, err = _launch(capsys, ["launcher=local", "nproc=1", "training.steps=3", "--dry-run"])
    assert code == 0 and shlex.split(out.strip())[0] == "train" and "dry run: nothing started." in err


# ----------------------------------------------------------------------------- real Slurm
def _slurm_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm cluster (tests/harness/slurm_cluster.sh) runs its daemons as root; not root here"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install it (tests/harness/slurm_cluster.sh)"
    return None


def _daemons_running() -> bool:
    for f in (SLURM_DIR / "run/slurmctld.pid", SLURM_DIR / "run/slurmd.pid"):
        try:
            os.kill(int(f.read_text().strip()), 0)
        except (OSError, ValueError):
            return False
    return True


@pytest.fixture(scope="module")
def slurm_cluster():
    reason = _slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    started = False
    if not _daemons_running():  # reuse a cluster someone already brought up; stop only ours
        up = subprocess.run(["bash", str(HARNESS), "up"], capture_output=True, text=True, timeout=900)
        if up.returncode == CANNOT_RUN:
            pytest.skip(up.stdout.strip().splitlines()[-1] if up.stdout.strip() else "slurm_cluster.sh cannot run here")
        assert up.returncode == 0, f"slurm_cluster.sh up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        started = True
    conf = str(SLURM_DIR / "slurm.conf")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        if started:
            subprocess.run(["bash", str(HARNESS), "down"], capture_output=True, text=True, timeout=120)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def _job(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def _fail_with_context(events, code, out, err, batch, run):
    """Everything needed to tell why a Slurm run went wrong, unabridged (pytest.fail keeps long text)."""
    job = events.get("job")
    ctld = SLURM_DIR / "log" / "slurmctld.log"
    ranks = "\n".join(f"--- {p.relative_to(run)}\n{p.read_text()[-1500:]}"
                      for p in sorted((run / "logs").rglob("std*.log")) if p.stat().st_size)
    pytest.fail(f"events {events}\nlaunch exit code {code}\n--- launch stdout\n{out[-3000:]}\n--- launch stderr\n"
                f"{err[-3000:]}\n--- batch log\n{batch[-4000:]}\n--- scontrol show job {job}\n"
                f"{_job(job) if job else ''}\n--- slurmctld.log (tail)\n"
                f"{ctld.read_text()[-3000:] if ctld.is_file() else 'n/a'}\n--- rank logs\n{ranks[-6000:]}",
                pytrace=False)


def test_slurm_job_is_preempted_requeued_and_resumes(capsys, workdir, slurm_cluster):
    """debug_moe on 2 CPU ranks (nodes=1 gpus_per_node=2 device=cpu) through the generated script
    with --wait; USR1 to the batch shell mid-run (as --signal=B:USR1 would send it): both ranks
    checkpoint, the script requeues the job, the requeued job resumes from that checkpoint."""
    steps = 12
    run = workdir / "run"
    name = f"apiary-test-{os.getpid()}"
    events: dict = {}

    def driver():
        deadline = time.time() + 420
        try:
            while time.time() < deadline:  # job id, then training has done 2 steps
                ids = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True,
                                     text=True).stdout.split()
                if ids:
                    events["job"] = ids[0]
                if ids and len(_steps(run / "metrics.jsonl")) >= 2:
                    break
                time.sleep(1)
            else:
                raise TimeoutError("training did not reach step 2")
            job = events["job"]
            subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
            events["signalled_after"] = len(_steps(run / "metrics.jsonl"))
            while time.time() < deadline:  # requeued: Slurm holds it ~2 min (BeginTime); start it now
                info = _job(job)
                if info.get("Restarts") == "1" and info.get("JobState") == "PENDING":
                    # slurmd refuses a credential issued in the same second as the previous run's
                    # revocation ("Job credential revoked": the job fails); Slurm's own hold avoids
                    # that, and so does starting it from a later second.
                    time.sleep(2.0)
                    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
                    events["requeued"] = True
                    break
                if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                    break
                time.sleep(1)
        except Exception as e:  # noqa: BLE001 - reported by the test body
            events["error"] = repr(e)
        finally:
            if "error" in events and "job" in events:
                subprocess.run(["scancel", events["job"]])  # unblocks --wait

    th = threading.Thread(target=driver, daemon=True)
    th.start()
    code, out, err = _launch(capsys, [
        "recipe=debug_moe", "launcher=slurm", "nodes=1", "gpus_per_node=2", "device=cpu", "cpus_per_task=2",
        "time=15", "preempt_signal_s=60", f"job_name={name}", f"training.steps={steps}",
        "checkpoint.interval=100", "logging.tensorboard=false", f"output_dir={run}", "--wait"])
    th.join(timeout=60)
    batch_logs = list((run / "logs").glob("slurm-*.out"))
    batch = batch_logs[0].read_text() if batch_logs else ""
    if "error" in events or code != 0 or not events.get("requeued"):
        _fail_with_context(events, code, out, err, batch, run)
    job = events["job"]
    info = _job(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info

    # the script lives in the run directory; the batch log spans both runs of the job
    assert (run / "train.sbatch").is_file() and f"submitted Slurm job {job}" in out
    k = int(re.search(r"resuming from checkpoint step-(\d+)", batch).group(1))
    assert 2 <= k < steps
    assert "USR1" in batch and f"requeueing job {job}" in batch and "training exited with code 0" in batch

    # per-rank logs of the preempted run: both ranks stopped after step k and saved it
    for rank in (0, 1):
        first = list((run / "logs" / f"job{job}.0" / "node0").glob(f"*/attempt_0/{rank}/stderr.log"))
        assert first, sorted(p.relative_to(run) for p in (run / "logs").rglob("*"))
        text = first[0].read_text()
        assert f"rank {rank}: preempted" in text and f"after step {k}; checkpoint step-{k} saved" in text, text[-2000:]
        assert list((run / "logs" / f"job{job}.1" / "node0").glob(f"*/attempt_0/{rank}/stderr.log"))
    # the step lines come from rank 0's log; the resumed run continues at k + 1
    rank0 = next((run / "logs" / f"job{job}.1" / "node0").glob("*/attempt_0/0/stdout.log")).read_text()
    assert re.search(rf"step\s+{k + 1}/{steps}", rank0), rank0[-2000:]

    # the first start's ranks loaded the run apiary launch resolved at submit time (its launch, with the
    # launcher's keys, is the run's first); the requeued job's ranks resolved the resume themselves
    launches = [json.loads(x) for x in (run / "launches.jsonl").read_text().splitlines()]
    assert (run / "resolved.yaml").is_file() and len(launches) == 2, launches
    assert launches[0]["overrides"][0] == "launcher=slurm", launches[0]
    assert "checkpoint.resume=true" in launches[1]["overrides"], launches[1]

    # checkpoints: the preemption's and the last; metrics: every step exactly once
    for s in (k, steps):
        assert (run / "checkpoint" / f"step-{s}" / ".metadata").is_file(), s
    assert _steps(run / "metrics.jsonl") == list(range(1, steps + 1))

    # launching the finished run again: nothing to resume; with more steps it would resume
    code, _, err = _launch(capsys, ["launcher=slurm", "nodes=1", "gpus_per_node=2", "device=cpu",
                                    f"output_dir={run}", "checkpoint.resume=true", f"training.steps={steps}",
                                    "--dry-run"])
    assert code == 2 and f"already at step {steps}" in err
    code, script, err = _launch(capsys, ["launcher=slurm", "nodes=1", "gpus_per_node=2", "device=cpu",
                                         f"output_dir={run}", "checkpoint.resume=true",
                                         f"training.steps={steps + 4}", f"lr.total_steps={steps + 4}", "--dry-run"])
    assert code == 0, err
    assert f"OUTPUT_DIR={run}" in script
