"""The embedded default trains end to end on CPU; resume continues with the same next loss;
2 gloo ranks (FSDP2 + EP=2) follow the 1-rank trajectory on the same global batch."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import TRAJ_LOSS_REL, read_metrics, run_cli, train_here


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    """One seed checkpoint of the default recipe (`train checkpoint.create_seed=true`), the common
    start of the 1-rank and 2-rank runs of the tests below: as a checkpoint.load_path override."""
    work = tmp_path_factory.mktemp("seed")
    p = train_here(["train", "checkpoint.create_seed=true", "output_dir=seed"], work)
    assert p.returncode == 0, p.stderr[-3000:]
    return f"checkpoint.load_path={work / 'seed' / 'checkpoint' / 'step-0'}"


def test_default_trains_and_resumes(workdir):
    p = run_cli(["train"], cwd=workdir)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = list((workdir / "runs" / "debug_moe").iterdir())
    assert len(runs) == 1
    run = runs[0]
    m = read_metrics(run)
    assert [r["step"] for r in m] == list(range(1, 21))
    for key in ("loss", "grad_norm", "tokens_per_s", "tflops_per_gpu", "tflops_per_gpu_torchtitan", "peak_mem_bytes"):
        assert all(key in r for r in m)
    # both FLOPs counts labelled, neither claimed without a GPU (tests/test_flops_count.py: a GPU's record)
    assert all(r["tflops_per_gpu"] is None and r["tflops_per_gpu_torchtitan"] is None for r in m)
    assert all(r["autotuned_kernels"] == 0 and r["autotune_s"] == 0 for r in m)  # no Triton on CPU
    first, last = m[0]["loss"], sum(r["loss"] for r in m[-3:]) / 3
    assert last < first - 1.0, (first, last)  # byte-level LM learns fast on the packaged corpus
    assert (run / "config.yaml").is_file() and "flavor: tiny_moe" in (run / "config.yaml").read_text()
    assert list((run / "tb").rglob("events.out.tfevents*"))
    assert (run / "checkpoint" / "step-10" / ".metadata").is_file()
    assert (run / "checkpoint" / "step-20" / ".metadata").is_file()
    assert "step    20/20" in p.stdout
    # piped, the console tells the story plainly: one line per step with elapsed and ETA, the summary,
    # no control codes and none of torchtitan's CPU noise (tests/test_progress.py: the terminal)
    steps = [ln for ln in p.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 20 and all(" elapsed " in ln and " ETA " in ln for ln in steps)
    assert "\x1b" not in p.stdout and "run summary" in p.stdout
    for noise in ("lspci", "fallback to A100", "safetensors.index.json", "0 kernels tuned", "{'dp_replicate'",
                  "TFLOPs/GPU", "done: step"):
        assert noise not in p.stdout + p.stderr, noise
    assert not (run / "comm_traces").exists()  # nothing traced on CPU: no empty folder
    assert not [k for k in m[-1] if k.startswith("plan_")]  # no GPU estimate next to a CPU's RSS
    summary = json.loads((run / "summary.json").read_text())
    last_ck = run.relative_to(workdir) / "checkpoint" / "step-20"  # output_dir as the run was given it
    assert summary["step"] == 20 and summary["checkpoint"] == str(last_ck)
    assert summary["tokens"] == sum(r["tokens"] for r in m) and summary["loss_last"] == m[-1]["loss"]
    assert f"checkpoint    {last_ck}" in p.stdout

    # resume from step 10 of a copy: the next loss must be the uninterrupted run's step 11
    copy = workdir / "resumed"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoint" / "step-20")
    (copy / "metrics.jsonl").unlink()
    p = run_cli(["train", "checkpoint.resume=true", f"output_dir={copy}"], cwd=workdir)
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = read_metrics(copy)
    assert resumed[0]["step"] == 11
    # one process, same weights, optimizer state, data position and arithmetic: bit-for-bit
    assert [r["loss"] for r in resumed] == [r["loss"] for r in m[10:]]


def test_two_ranks_fsdp2_ep2_match_one_rank(workdir, seed):
    steps = ["training.steps=5", "checkpoint.interval=100"]
    with ThreadPoolExecutor(2) as pool:  # the 1-rank run beside the 2 ranks, one thread each
        f1 = pool.submit(run_cli, ["train", *steps, seed, "training.global_batch=8", "output_dir=one"], cwd=workdir,
                         env={"OMP_NUM_THREADS": "1"})
        f2 = pool.submit(run_cli, ["train", *steps, seed, "nproc=2", "output_dir=two",
                                   f"training.kernel_cache={workdir / 'kc'}"], cwd=workdir)
        p1, p2 = f1.result(), f2.result()
    assert p1.returncode == 0, p1.stderr[-3000:]
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert p2.stdout.count("run summary") == 1 and "steps         5/5" in p2.stdout  # rank 0 of torchrun, once
    # torchrun's workers take the kernel cache (tests/test_first_step.py's check, on this run's ranks):
    # the folder is made by the ranks (the launching process does not configure caches)
    assert (workdir / "kc").is_dir()
    lay = json.loads((workdir / "two" / "layout.json").read_text())["dims"]
    assert lay["dp_shard"] == 2 and lay["ep"] == 2
    one, two = read_metrics(workdir / "one"), read_metrics(workdir / "two")
    assert len(one) == len(two) == 5
    assert two[0]["first_step_wall_s"] > 0
    # another split of the same batch (and EP): rounding-level differences from step 1 on, so
    # conftest's fp32 trajectory bound (the grad norm keeps its looser 1e-3)
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= TRAJ_LOSS_REL * abs(a["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * a["grad_norm"]
    assert one[-1]["loss"] < one[0]["loss"]


def test_pipeline_stages_log_the_last_stages_loss(workdir, seed):
    """parallel.pp=2 nproc=2: only the last stage computes the loss; rank 0 (the first stage) logged
    torchtitan's -1.0 in metrics.jsonl, the console and summary.json, and the held-out loss as
    -1/tokens. From one seed checkpoint, the pipeline's logged losses are the 1-rank run's."""
    steps = ["training.steps=3", "checkpoint.interval=100", "validation.interval=2", "validation.fraction=0.1",
             "logging.tensorboard=false"]
    with ThreadPoolExecutor(2) as pool:  # the 1-rank run beside the 2 ranks, one thread each
        f1 = pool.submit(run_cli, ["train", *steps, seed, "output_dir=one"], cwd=workdir, env={"OMP_NUM_THREADS": "1"})
        f2 = pool.submit(run_cli, ["train", *steps, seed, "parallel.pp=2", "nproc=2", "output_dir=pp"], cwd=workdir)
        p1, p2 = f1.result(), f2.result()
    assert p1.returncode == 0, p1.stderr[-3000:]
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert json.loads((workdir / "pp" / "layout.json").read_text())["dims"]["pp"] == 2
    one, pp = read_metrics(workdir / "one"), read_metrics(workdir / "pp")
    assert [r["step"] for r in pp] == [1, 2, 3]
    for a, b in zip(one, pp):
        for key in ("loss", "max_loss", "val_loss"):
            assert abs(a[key] - b[key]) <= TRAJ_LOSS_REL * abs(a[key]), (key, a, b)
    summary = json.loads((workdir / "pp" / "summary.json").read_text())
    assert summary["loss_first"] == pp[0]["loss"] > 1 and summary["val_loss_last"] == pp[-1]["val_loss"] > 1
    assert "loss -1.0000" not in p2.stdout and "loss 5." in p2.stdout, p2.stdout[-3000:]
    assert "Pipeline Parallel loss is not visible" not in p2.stdout + p2.stderr


def test_one_process_skips_torchtitans_closing_sleep(monkeypatch):
    """torchtitan's train() ends rank 0 with time.sleep(2) "for other ranks to complete": one process
    (world size 1) skips it, torchtitan.trainer's time module is put back afterwards, and a larger
    world keeps the sleep."""
    import time

    from framework import devices

    devices.install()  # device shims before torchtitan
    import torchtitan.trainer as tt

    from framework.train import trainer

    slept = []

    def loop(self):  # torchtitan's Trainer.train, reduced to its closing sleep
        tt.time.sleep(2)
        return "trained"

    monkeypatch.setattr(tt.Trainer, "train", loop)
    bare = object.__new__(trainer.ApiaryTrainer)  # no model: only train() runs
    bare._publisher = None  # nothing published, so nothing deferred to flush at the end
    monkeypatch.setattr(time, "sleep", slept.append)
    assert bare.train() == "trained"
    assert slept == [] and tt.time is time
    monkeypatch.setattr(trainer.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(trainer.dist, "get_world_size", lambda: 2)
    assert bare.train() == "trained"
    assert slept == [2]
