"""Time to first step (issue 17, CPU side): the first step's breakdown in metrics.jsonl, the
kernel cache under every launcher path, one tuning per kernel across processes sharing a cache
(a recorded fake autotuner through Triton's own disk-cache code: nothing autotunes on CPU),
`apiary warmup`, and the Slurm template's warmup line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from framework.train import first_step, kernel_cache

from conftest import ROOT, run_cli

BREAKDOWN = ("first_step_build_s", "first_step_wall_s", "first_step_compile_s", "first_step_autotune_s",
             "first_step_other_s")


def _records(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def test_first_step_breakdown_recorded_once_on_cpu(tmp_path):
    out, kc = tmp_path / "run", tmp_path / "kc"
    res = run_cli(["train", "recipe=debug_moe", "training.steps=2", "training.seq_len=64", f"output_dir={out}",
                   f"training.kernel_cache={kc}", "checkpoint.enable=false"], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    first, second = _records(out)
    assert all(first[k] >= 0 for k in BREAKDOWN)
    parts = first["first_step_compile_s"] + first["first_step_autotune_s"] + first["first_step_other_s"]
    assert parts <= first["first_step_wall_s"] + 0.003  # rounding of three parts
    assert first["first_step_compile_s"] == 0.0  # apiary's CPU path compiles nothing (compile off, no flex)
    assert first["first_step_autotuned_kernels"] == 0
    assert not any(k in second for k in BREAKDOWN)  # once
    assert res.stdout.count("first step: ") == 1 and "building the trainer before it took" in res.stdout
    assert kc.is_dir()  # the worker took the cache directory


def test_breakdown_parts_are_clamped_to_the_wall_time(monkeypatch):
    clock = iter([0.0, 10.0, 20.0])
    monkeypatch.setattr(first_step.time, "perf_counter", lambda: next(clock))
    compiled = iter([1.0, 9.0])  # 8 s compiled during the step
    monkeypatch.setattr(first_step, "compile_seconds", lambda: next(compiled))
    monkeypatch.setattr(kernel_cache, "LOG", kernel_cache.AutotuneLog())
    s = first_step.FirstStep()
    s.begin()
    s.step_started()
    kernel_cache.LOG(fn=None, key=(1,), best_config=None, configs_timings={}, duration=5.0, cache_hit=False)
    rec = s.record()
    assert rec == {"first_step_build_s": 10.0, "first_step_wall_s": 10.0, "first_step_compile_s": 8.0,
                   "first_step_autotune_s": 2.0, "first_step_autotuned_kernels": 1, "first_step_autotune_wait_s": 0.0,
                   "first_step_other_s": 0.0, "first_step_autotune_from_table": 0}
    assert s.record() == {}


def test_waiting_for_the_first_rollouts_is_not_build_time(monkeypatch):
    clock = iter([0.0, 40.0, 41.0])  # begin, step started, record
    monkeypatch.setattr(first_step.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(first_step, "compile_seconds", lambda: 0.0)
    monkeypatch.setattr(kernel_cache, "LOG", kernel_cache.AutotuneLog())
    s = first_step.FirstStep()
    s.begin()
    s.before_first_step(publish_s=0.5)  # the starting weights
    s.before_first_step(data_wait_s=37.2)  # the generator's first shard
    s.step_started()
    s.before_first_step(data_wait_s=5.0)  # a later step's wait is not the first step's
    rec = s.record()
    assert rec["first_step_build_s"] == 2.3 and rec["first_step_data_wait_s"] == 37.2
    assert rec["first_step_publish_s"] == 0.5 and rec["first_step_wall_s"] == 1.0
    line = first_step.describe(rec)
    assert line.endswith("building the trainer before it took 2.3 s, publishing the starting weights 0.5 s, "
                         "waiting for the first records 37.2 s"), line
    plain = {k: v for k, v in rec.items() if k not in ("first_step_data_wait_s", "first_step_publish_s")}
    assert first_step.describe(plain).endswith("; building the trainer before it took 2.3 s")  # no wait, no publish


def test_waiting_for_another_process_tuning_counts_as_autotuning(tmp_path, monkeypatch):
    clock = iter([0.0, 1.0, 2.0])
    monkeypatch.setattr(first_step.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(kernel_cache, "LOG", kernel_cache.AutotuneLog())
    monkeypatch.setattr(first_step, "compile_seconds", lambda: 0.0)
    s = first_step.FirstStep()
    s.begin()
    s.step_started()
    kernel_cache.LOG.total_wait_seconds += 0.2  # as tune_lock adds while blocked in flock
    kernel_cache.LOG(fn=None, key=(1,), best_config=None, configs_timings={}, duration=None, cache_hit=True)
    rec = s.record()
    assert rec["first_step_autotune_wait_s"] == 0.2 and rec["first_step_autotune_s"] == 0.2
    assert rec["first_step_autotuned_kernels"] == 0 and rec["first_step_other_s"] == 0.8


def test_kernel_cache_keeps_inductor_graph_and_autograd_caches_and_replaces_torchs_default(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setattr("os.environ", dict(__import__("os").environ))
    import os

    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
              "TORCHINDUCTOR_AUTOGRAD_CACHE", "TRITON_CACHE_AUTOTUNING"):
        os.environ.pop(k, None)
    assert cache_dir() == os.path.abspath(default_cache_dir())  # torch writes its default into the env
    kernel_cache.configure(str(tmp_path / "kc"), True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kc" / "inductor") == cache_dir()
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    from torch._functorch import config as fconfig
    from torch._inductor import config as iconfig

    assert iconfig.fx_graph_cache and fconfig.enable_autograd_cache


def test_unusable_kernel_cache_falls_back_with_a_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    env = {}
    with caplog.at_level("WARNING"):
        added = kernel_cache.configure(str(blocker / "kc"), True, env)
    assert added == env == {"TRITON_CACHE_AUTOTUNING": "1"}
    assert "is not used" in caplog.text and "writable directory" in caplog.text


FAKE_TUNER = textwrap.dedent('''
    import json, os, sys, time, types
    import triton, triton.language as tl
    import triton.compiler.compiler as cc
    import triton.runtime.autotuner as at
    from framework.train import kernel_cache

    @triton.jit
    def fake_kernel(x, BLOCK: tl.constexpr):
        pass

    # no GPU here: the target and backend hash are recorded constants; the rest is Triton's code
    at.driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_target=lambda: "recorded"))
    cc.make_backend = lambda target: types.SimpleNamespace(hash=lambda: "recorded-h200")
    kc, log, lock = sys.argv[1], sys.argv[2], sys.argv[3] == "lock"
    if lock:
        kernel_cache.configure(kc, True)
    else:
        os.environ["TRITON_CACHE_DIR"] = kc + "/triton"
    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]
    tuner = types.SimpleNamespace(fn=fake_kernel, cache={}, configs_timings=None)
    key = (4096, "torch.bfloat16")

    def bench():  # recorded timings: BLOCK=32 wins
        time.sleep(1.0)
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        tuner.configs_timings = {configs[0]: [2.0], configs[1]: [1.0]}
        tuner.cache[key] = configs[1]

    ready = os.path.join(os.path.dirname(log), "ready")  # start together: imports take different times
    os.makedirs(ready, exist_ok=True)
    open(os.path.join(ready, str(os.getpid())), "w").close()
    while len(os.listdir(ready)) < int(sys.argv[4]):
        time.sleep(0.01)
    hit = at.Autotuner.check_disk_cache(tuner, key, configs, bench)
    print(json.dumps({"hit": hit, "best": tuner.cache[key].kwargs, "waited": kernel_cache.LOG.total_wait_seconds}))
''')


def _tuners(tmp_path, n, mode="lock"):
    script = tmp_path / "fake_tuner.py"
    script.write_text(FAKE_TUNER)
    log = tmp_path / "benchmarked.log"
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    import shutil

    shutil.rmtree(tmp_path / "ready", ignore_errors=True)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "kc"), str(log), mode, str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0, e[-2000:]
        outs.append(json.loads(o.strip().splitlines()[-1]))
    return outs, (log.read_text().split() if log.exists() else []), e


def test_two_processes_sharing_a_cache_tune_a_kernel_once(tmp_path):
    pytest.importorskip("triton")
    outs, benched, _ = _tuners(tmp_path, 2)
    assert len(benched) == 1  # one process tuned; the other waited on the lock and read its result
    assert sorted(o["hit"] for o in outs) == [False, True]
    assert next(o for o in outs if o["hit"])["waited"] > 0.3  # it waited for the other's 1 s of tuning
    assert all(o["best"] == {"BLOCK": 32} for o in outs)
    entries = list((tmp_path / "kc" / "triton").rglob("*.autotune.json"))
    assert len(entries) == 1 and json.loads(entries[0].read_text())["key"] == [4096, "torch.bfloat16"]
    assert not list((tmp_path / "kc" / "triton").rglob("tmp.pid_*"))  # Triton's temporaries renamed away
    # a later launch (training after `apiary warmup`) finds the entry and tunes nothing
    outs, benched, _ = _tuners(tmp_path, 1)
    assert outs[0]["hit"] is True and len(benched) == 1


def test_a_corrupt_autotuning_entry_is_tuned_again_with_a_warning(tmp_path):
    pytest.importorskip("triton")
    _tuners(tmp_path, 1)
    (entry,) = (tmp_path / "kc" / "triton").rglob("*.autotune.json")
    entry.write_text('{"configs_timings": [[{"kw')  # cut short
    outs, benched, err = _tuners(tmp_path, 1)
    assert (outs[0]["hit"], outs[0]["best"], len(benched)) == (False, {"BLOCK": 32}, 2)
    assert "unreadable autotuning cache entry for fake_kernel" in err


def test_warmup_trains_two_steps_and_lists_the_cache(tmp_path):
    kc = tmp_path / "kc"
    res = run_cli(["apiary", "warmup", "recipe=debug_moe", "training.seq_len=64", "training.steps=50",
                   f"training.kernel_cache={kc}"], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "training.steps=50 -> training.steps=2" in res.stdout
    assert "step     2/2" in res.stdout and "first step: " in res.stdout
    # the CPU path compiles and tunes nothing, so the listing is empty but names the job's directories
    assert f"triton   {kc / 'triton'}: 0 files" in res.stdout
    assert f"inductor {kc / 'inductor'}: 0 files" in res.stdout
    assert not (tmp_path / "runs").exists()  # temporary output, removed


def test_warmup_of_a_live_vllm_loop_recipe_needs_no_generator_or_engine(tmp_path):
    """The loop's recipe follows a generator's folder and hands weights to a vLLM engine; warmup trains its
    shapes on the packaged rollouts with publication off, so it runs alone (here: a CPU without vLLM)."""
    kc = tmp_path / "kc"
    res = run_cli(["apiary", "warmup", "recipe=qwen35_debug_grpo_vllm",
                   f"training.kernel_cache={kc}"], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = " ".join(res.stdout.split())
    assert "the job follows live/rollouts; warmup trains on the packaged rollouts" in out
    assert "warmup publishes none" in out and "step 2/2" in out
    assert "this machine has no GPU: nothing is compiled or tuned for one here" in out  # CPU: it says so
    assert not (tmp_path / "live").exists()  # no rollouts folder waited on, no weights published


@pytest.mark.parametrize("argv, needle", [
    (["nproc=8"], "apiary warmup nproc=8"),
    (["launcher=slurm"], "launcher options belong to the job"),
    (["training.cache_autotuning=false"], "would not be kept"),
])
def test_warmup_refuses_what_it_cannot_honour(tmp_path, monkeypatch, capsys, argv, needle):
    from toolkit.cli import apiary_main

    monkeypatch.chdir(tmp_path)
    assert apiary_main(["warmup", "recipe=debug_moe", *argv]) == 2
    assert needle in " ".join(capsys.readouterr().err.split())


def test_warmup_refuses_an_unwritable_cache(tmp_path, monkeypatch, capsys):
    from toolkit.cli import apiary_main

    (tmp_path / "file").write_text("x")
    monkeypatch.chdir(tmp_path)
    assert apiary_main(["warmup", "recipe=debug_moe", f"training.kernel_cache={tmp_path / 'file' / 'kc'}"]) == 2
    assert "cannot hold the cache" in " ".join(capsys.readouterr().err.split())


def _dry_run(capsys, argv):
    from toolkit.launch import launch_main

    code = launch_main(["recipe=debug_moe", "launcher=slurm", "nodes=2", "gpus_per_node=4", *argv, "--dry-run"])
    cap = capsys.readouterr()
    return code, cap.out, " ".join(cap.err.split())


def test_slurm_template_runs_warmup_before_the_job(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    kc = tmp_path / "kc"
    code, script, err = _dry_run(capsys, ["launcher.warmup=true", f"training.kernel_cache={kc}",
                                          "training.seq_len=128"])
    assert code == 0, err
    warm = next(l for l in script.splitlines() if "toolkit.cli warmup" in l)
    assert f"training.kernel_cache={kc}" in warm and "training.seq_len=128" in warm
    assert "srun --nodes=1 --ntasks=1 --gpus=1" in script
    assert script.index("toolkit.cli warmup") < script.index("-m framework.train.preempt train")
    train_args = next(l for l in script.splitlines() if l.startswith("TRAIN_ARGS=("))
    assert f"training.kernel_cache={kc}" in train_args  # the job's ranks read the same cache
    code, script, err = _dry_run(capsys, [f"training.kernel_cache={kc}"])
    assert code == 0 and "toolkit.cli warmup" not in script  # off by default
    code, _, err = _dry_run(capsys, ["launcher.warmup=true"])
    assert code == 2 and "launcher.warmup=true: needs training.kernel_cache" in err


# torchrun workers take the kernel cache: asserted on the 2-rank run of
# tests/test_train_cpu.py::test_two_ranks_fsdp2_ep2_match_one_rank (training.kernel_cache given to nproc=2),
# which saves a launch of its own here


def test_a_filesystem_without_flock_tunes_without_the_lock(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(*a):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING"), kernel_cache.tune_lock(tmp_path / "locks" / "k.lock") as held:
        assert held is False
    assert "No locks available" in caplog.text and "tunes without waiting" in caplog.text
    monkeypatch.undo()
    with kernel_cache.tune_lock(tmp_path / "locks" / "k.lock") as held:
        assert held is True


def test_without_the_lock_both_processes_tune(tmp_path):
    """Baseline partner of the lock: Triton alone lets every process sharing a cache tune the kernel."""
    pytest.importorskip("triton")
    outs, benched, _ = _tuners(tmp_path, 2, mode="nolock")
    assert len(benched) == 2 and [o["hit"] for o in outs] == [False, False]


def test_a_long_first_step_says_so_while_it_runs_and_stops_when_it_ends(monkeypatch, capsys):
    """A first step still running after NOTE_EVERY_S prints what it has done so far (compile, autotuning,
    the kernel being tuned now) each period on rank 0; the notes stop once the step is recorded."""
    monkeypatch.setattr(first_step, "NOTE_EVERY_S", 0.05)
    monkeypatch.setattr(first_step, "compile_seconds", lambda: 0.0)
    monkeypatch.setattr(kernel_cache, "LOG", kernel_cache.AutotuneLog())
    monkeypatch.delenv("RANK", raising=False)
    s = first_step.FirstStep()
    s.begin()
    s.step_started()
    kernel_cache.LOG(fn=None, key=(1,), best_config=None, configs_timings={}, duration=40.0, cache_hit=False)
    kernel_cache.LOG.tuning_now = "chunk_bwd_kernel_dhu"
    time.sleep(0.3)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("first step: still running")]
    assert len(lines) >= 2, lines
    assert "autotuning 40 s: 1 kernel tuned, tuning chunk_bwd_kernel_dhu now" in lines[-1], lines[-1]
    s.record()
    time.sleep(0.2)
    assert "still running" not in capsys.readouterr().out  # the notes end with the step


def test_only_rank_0_notes_a_long_first_step(monkeypatch, capsys):
    monkeypatch.setattr(first_step, "NOTE_EVERY_S", 0.05)
    monkeypatch.setenv("RANK", "1")
    s = first_step.FirstStep()
    s.begin()
    s.step_started()
    time.sleep(0.2)
    s.record()
    assert "still running" not in capsys.readouterr().out


def test_the_kernel_being_tuned_is_named_while_triton_benchmarks_it(tmp_path, monkeypatch):
    """kernel_cache's lock around Triton's disk-cache check names the kernel while its configs run."""
    at = pytest.importorskip("triton.runtime.autotuner")
    monkeypatch.setattr(kernel_cache, "LOG", kernel_cache.AutotuneLog())
    seen = []
    wrapped = kernel_cache._locked_check_disk_cache(lambda self, key, configs, bench: bench() or False)
    tuner = type("T", (), {"fn": type("F", (), {"__name__": "my_kernel", "cache_key": "k"})()})()
    monkeypatch.setattr(kernel_cache, "jit_function", lambda t: t.fn)
    monkeypatch.setattr(kernel_cache, "_lock_path", lambda *a: tmp_path / "lock")
    wrapped(tuner, ("key",), [at.Config({})], lambda: seen.append(kernel_cache.LOG.tuning_now))
    assert seen == ["my_kernel"] and kernel_cache.LOG.tuning_now is None


def test_a_long_first_step_with_nothing_tuning_says_where_the_training_thread_is(monkeypatch):
    """No compile, no autotuning, yet the step runs long (a wait, a lock, a collective no peer joins): the
    note names the training thread's innermost frames, so the log alone says where it is."""
    monkeypatch.setattr(first_step, "compile_seconds", lambda: 0.0)
    monkeypatch.setattr(kernel_cache, "LOG", kernel_cache.AutotuneLog())
    release, lines = threading.Event(), []
    s = first_step.FirstStep()

    def stuck_in_the_step():
        s.step_started()
        release.wait(10)

    monkeypatch.setattr(first_step, "NOTE_EVERY_S", 0.0)  # no notes thread; the line is read directly
    t = threading.Thread(target=stuck_in_the_step)
    t.start()
    try:
        for _ in range(100):
            if s.thread is not None:
                break
            time.sleep(0.01)
        time.sleep(0.05)
        lines.append(s.progress_line())
        kernel_cache.LOG.tuning_now = "chunk_fwd_kernel"  # a kernel being tuned is named instead
        lines.append(s.progress_line())
    finally:
        release.set()
        t.join()
    assert "now in wait (" in lines[0] and "stuck_in_the_step (tests/test_first_step.py:" in lines[0], lines[0]
    assert "tuning chunk_fwd_kernel now" in lines[1] and "now in" not in lines[1], lines[1]
