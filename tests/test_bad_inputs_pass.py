"""The second pass of bad inputs (docs/bad_inputs_second_pass.md, docs/reliability.md "Bad input, second
pass"): every case that leaked a traceback, was silently accepted or said the wrong thing now exits 2
with one paragraph naming the key, before anything is written; or, where the input is good, takes
effect. In process (train_main, apiary_main), so the whole file takes seconds;
benchmarks/bad_inputs_pass.py runs the full list through the console entries.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _refused(code: int, err: str, workdir, *needles, keep=()) -> None:
    err = " ".join(err.split())
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err, err
    assert "error apiary:" in err, err
    err = err[err.index("error apiary:"):]
    assert err.count("error apiary:") == 1, err  # one paragraph
    for n in needles:
        assert n in err, (n, err)
    left = sorted(p.name for p in workdir.iterdir() if p.name not in {*FIXTURES, *keep})
    assert not left, left  # nothing written: no runs/, no output_dir, no copy


FIXTURES = {"bad_calib.json"}


@pytest.fixture
def clean_env(monkeypatch):
    """As from a fresh shell: no launcher variables (an in-process training earlier in the session
    leaves RANK, WORLD_SIZE, ... behind)."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
              "MASTER_PORT", "APIARY_DEVICE"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


CFG = ["--cfg", "job"]

TRAIN_CASES = [
    # model.*
    (["model.vocab_size=0", *CFG], ["model.vocab_size=0", "must be >= 2"]),
    (["model.vocab_size=-5", *CFG], ["model.vocab_size=-5", "must be >= 2"]),
    # training.*
    (["training.max_skips=3"], ["training.max_skips=3", "training.on_nonfinite=skip", "would be ignored"]),
    (["training.kernel_cache=", *CFG], ["training.kernel_cache=", "is empty", "training.kernel_cache=null"]),
    # data.*
    (["data.path="], ["data.path=", "is empty", "data.path=null"]),
    (["data.name="], ["data.name=", "is empty", "data.name=packaged"]),
    (["data.path=~/bees.jsonl"], ["override data.path=~/bees.jsonl", "data.path=$HOME/bees.jsonl",
                                  "data.path='~/bees.jsonl'"]),
    (["data.wait_timeout=30"], ["data.wait_timeout=30", "data.follow=true", "would be ignored"]),
    # moe.*
    (["moe.load_balance_coeff=inf", *CFG], ["moe.load_balance_coeff=inf", "must be > 0 and finite"]),
    (["recipe=debug_dense", "moe.chunk=chunk2", *CFG], ["moe.chunk=chunk2", "dense model", "no MoE layers"]),
    (["recipe=debug_dense", "moe.load_balance_coeff=0.01", *CFG], ["moe.load_balance_coeff=0.01", "dense model"]),
    # publish.*
    (["publish.dir=weights"], ["publish.dir=weights", "publish.interval=N", "would be ignored"]),
    (["publish.keep=5"], ["publish.keep=5", "publish.interval=N"]),
    (["publish.dtype=bfloat16"], ["publish.dtype=bfloat16", "publish.interval=N"]),
    # optimizer.* / lr.*
    (["optimizer.eps=inf", *CFG], ["optimizer.eps=inf", "finite number > 0"]),
    (["optimizer.weight_decay=inf", *CFG], ["optimizer.weight_decay=inf", "finite number >= 0"]),
    (["lr.warmup_steps=5", "lr.decay_ratio=0.9", "training.steps=20", *CFG],
     ["lr.decay_ratio=0.9", "decays over 18", "23 steps do not fit in 20", "lr.decay_ratio <= 0.75"]),
    # validation.*
    (["validation.steps=3"], ["validation.steps=3", "validation.interval=N", "would be ignored"]),
    # checkpoint.*
    (["checkpoint.keep_latest_k=1"], ["checkpoint.keep_latest_k=1", "0 (keep all) or >= 2"]),
    (["checkpoint.resume=true", "checkpoint.enable=false", "output_dir=run"],
     ["checkpoint.resume=true with checkpoint.enable=false", "start over at step 1"]),
    (["checkpoint.enable=false", "checkpoint.load_path=seed/step-0", *CFG],
     ["checkpoint.load_path=seed/step-0 with checkpoint.enable=false", "initialised weights"]),
    (["checkpoint.create_seed=true", "checkpoint.resume=true", "output_dir=run", *CFG],
     ["checkpoint.create_seed=true with checkpoint.resume=true", "cannot continue a run"]),
    (["checkpoint.enable=false", "checkpoint.interval=5"], ["checkpoint.interval=5", "checkpoint.enable=true"]),
    (["checkpoint.enable=false", "checkpoint.keep_latest_k=2"], ["checkpoint.keep_latest_k=2", "checkpoint.enable=true"]),
    # logging.*
    (["logging.wandb_project=bees"], ["logging.wandb_project=bees", "logging.wandb=true", "would be ignored"]),
    # parallel.*
    (["parallel.pp_microbatch_size=2", *CFG], ["parallel.pp_microbatch_size=2", "parallel.pp=N (N > 1)"]),
    # the Slurm launcher's options (train launcher=slurm resolves them as apiary launch does)
    (["launcher=slurm", "launcher.mem=lots", *CFG], ["launcher.mem=lots", "not a Slurm memory size", "mem=500G"]),
    (["launcher=slurm", "launcher.rdzv_port=70000", *CFG], ["launcher.rdzv_port=70000", "1-65535"]),
    (["launcher=slurm", "launcher.partition=", *CFG], ["launcher.partition=", "is empty"]),
    (["launcher=slurm", "launcher.job_name=my job", *CFG], ["launcher.job_name=my job", "holds a space"]),
]


@pytest.mark.parametrize("argv,needles", TRAIN_CASES, ids=[" ".join(a) for a, _ in TRAIN_CASES])
def test_train_refuses_before_anything_is_written(workdir, clean_env, capsys, argv, needles):
    from framework.cli import train_main

    code = train_main(argv)
    _refused(code, capsys.readouterr().err, workdir, *needles)


ENV_CASES = [
    ({"WORLD_SIZE": "abc"}, CFG, ["WORLD_SIZE=abc", "whole number >= 1", "unset WORLD_SIZE"]),
    ({"WORLD_SIZE": "0"}, CFG, ["WORLD_SIZE=0", "whole number >= 1"]),
    ({"WORLD_SIZE": "4"}, ["output_dir=run"], ["WORLD_SIZE=4", "without RANK", "left over"]),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["output_dir=run"], ["RANK=0 WORLD_SIZE=2", "MASTER_PORT is not set"]),
    ({"APIARY_DEVICE": "gpux"}, CFG, ["APIARY_DEVICE=gpux", "APIARY_DEVICE=cpu", "would be ignored"]),
]


@pytest.mark.parametrize("env,argv,needles", ENV_CASES, ids=[" ".join(f"{k}={v}" for k, v in e.items())
                                                            for e, _, _ in ENV_CASES])
def test_environment_variables_are_checked(workdir, clean_env, capsys, env, argv, needles):
    from framework.cli import train_main

    for k, v in env.items():
        clean_env.setenv(k, v)
    code = train_main(argv)
    _refused(code, capsys.readouterr().err, workdir, *needles)


APIARY_CASES = [
    (["launch", "launcher=slurm", "mem=lots", "--dry-run"], ["launcher.mem=lots", "not a Slurm memory size"]),
    (["launch", "launcher=slurm", "rdzv_port=70000", "--dry-run"], ["launcher.rdzv_port=70000", "TCP port"]),
    (["launch", "launcher=slurm", "partition=", "--dry-run"], ["launcher.partition=", "is empty"]),
    (["launch", "launcher=slurm", "job_name=my job", "--dry-run"], ["launcher.job_name=my job", "holds a space"]),
    (["cp", "debug_moe", "/proc/apiary.yaml"], ["apiary cp debug_moe /proc/apiary.yaml", "cannot write"]),
    (["cp-template", "slurm", "/proc/train.sbatch.j2"], ["apiary cp-template slurm", "cannot write"]),
    (["plan", "calibration=bad_calib.json"], ["calibration=bad_calib.json", "bad_calib.json:2:1 is not JSON or YAML"]),
]


@pytest.mark.parametrize("argv,needles", APIARY_CASES, ids=[" ".join(a) for a, _ in APIARY_CASES])
def test_apiary_refuses_before_anything_is_written(workdir, clean_env, capsys, argv, needles):
    from toolkit.cli import apiary_main

    (workdir / "bad_calib.json").write_text("{not: [json\n")
    code = apiary_main(argv)
    _refused(code, capsys.readouterr().err, workdir, *needles)


def _step(folder, n: int):
    """A complete checkpoint step as integrity sees it (.metadata, a shard, manifest.json): no tensors,
    which nothing here loads (every case is refused first)."""
    from framework.train import integrity

    d = folder / "checkpoint" / f"step-{n}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta")
    (d / "__0_0.distcp").write_bytes(b"shard" * 10)
    integrity.write_manifest(d, n, integrity.entries(d, integrity.list_files(d)))
    return d


def _listing(folder) -> list:
    return sorted((str(q), q.stat().st_size, q.stat().st_mtime_ns) for q in folder.rglob("*"))


@pytest.mark.parametrize("extra,needles", [
    (["checkpoint.load_path=seed/checkpoint/step-0"],
     ["checkpoint.resume=true with checkpoint.load_path=seed/checkpoint/step-0", "both name what to load",
      "launched without one"]),
    (["checkpoint.enable=false"], ["checkpoint.resume=true with checkpoint.enable=false", "start over at step 1"]),
    (["checkpoint.create_seed=true"], ["checkpoint.create_seed=true with checkpoint.resume=true",
                                       "cannot continue a run"]),
])
def test_a_resume_that_would_not_continue_the_run_is_refused(workdir, clean_env, capsys, extra, needles):
    """On a run with a verified step-2: a resume that would ignore load_path, start over without
    checkpoints, or write a seed into the run is refused, the run folder untouched."""
    from omegaconf import OmegaConf

    from framework.cli import train_main
    from framework.resolve.resolver import resolve

    run = workdir / "run"
    cfg = resolve(None, ["output_dir=run", "training.steps=2"], for_training=False).cfg
    run.mkdir()
    OmegaConf.save(cfg, run / "config.yaml")
    _step(run, 2)
    _step(workdir / "seed", 0)
    before = _listing(run)
    code = train_main(["checkpoint.resume=true", "output_dir=run", "training.steps=4", "lr.total_steps=4", *extra])
    _refused(code, capsys.readouterr().err, workdir, *needles, keep=("run", "seed"))
    assert _listing(run) == before  # the run untouched


# ---------------------------------------------------------------- settings that now take effect


def test_a_relative_load_path_reaches_torchtitan_absolute(workdir, clean_env):
    """torchtitan's checkpointer refuses a relative initial_load_path (a ValueError traceback in the
    worker before): the trainer config gets it absolute."""
    from framework.resolve.resolver import resolve
    from framework.train.build import initial_load_path

    r = resolve(None, ["checkpoint.load_path=seed/step-0", "output_dir=run"], for_training=False)
    # what trainer_config hands torchtitan (whose checkpointer Config raises "initial_load_path must be an
    # absolute path" for seed/step-0; importing it here costs seconds: benchmarks/bad_inputs_pass.py
    # case 58 trains from a relative step end to end)
    assert initial_load_path(r.cfg) == str(workdir / "seed" / "step-0")
    assert r.cfg.checkpoint.load_path == str(workdir / "seed" / "step-0")  # stored absolute (framework/resolve/paths.py)


def test_a_home_relative_path_is_expanded(workdir, clean_env):
    """`data.path='~/x.jsonl'` (quoted for Hydra; the shell leaves `key=~/...` as it is) reads the home
    folder's file."""
    from framework.resolve.resolver import resolve

    (workdir / "home").mkdir()
    (workdir / "home" / "bees.jsonl").write_text(('{"text": "' + "bees make honey " * 40 + '"}\n') * 3)
    clean_env.setenv("HOME", str(workdir / "home"))
    r = resolve(None, ["data.path='~/bees.jsonl'", "output_dir=run"])  # quoted: Hydra takes no bare ~ in a value
    assert r.cfg.data.path == str(workdir / "home" / "bees.jsonl")
    assert f"data: local text {workdir / 'home' / 'bees.jsonl'}: 3 documents" in r.data_summary
    assert not (workdir / "run").exists()


def test_the_last_step_is_logged_whatever_log_freq():
    """logging.log_freq=100 with 5 steps logged step 1 only: the summary said `steps 1/5` and the last
    loss was step 1's. The last step is logged too, its step time over the steps since the record before."""
    from framework.report.metrics import ApiaryMetrics

    m = object.__new__(ApiaryMetrics)
    m.config = SimpleNamespace(log_freq=3, total_steps=5)
    assert [s for s in range(1, 6) if m.should_log(s)] == [1, 3, 5]
    seen = []
    m._log = lambda step, *a, **k: seen.append((step, m.config.log_freq))
    for s in (1, 3, 5):
        m.log(s, 0.0, 0.0, 0.0)
    assert seen == [(1, 1), (3, 2), (5, 2)] and m.config.log_freq == 3  # torchtitan divides by log_freq


def test_warmup_drops_the_jobs_checkpoint_settings():
    """apiary warmup turns checkpointing off; the job's checkpoint.* overrides are noted, not refused."""
    from toolkit.warmup import warmup_overrides

    recipe, out, notes = warmup_overrides(["recipe=debug_moe", "checkpoint.interval=50", "checkpoint.keep_latest_k=2",
                                           "training.seq_len=128"], "tmp")
    assert recipe == "debug_moe" and "training.seq_len=128" in out
    assert not [o for o in out if o.startswith(("checkpoint.interval", "checkpoint.keep_latest_k"))]
    assert any("checkpoint.interval=50 is not used" in n for n in notes)


def test_recipe_values_of_a_setting_turned_off_are_not_refused(workdir, clean_env):
    """Only what the command line sets is refused as ignored: a recipe's checkpoint.interval stays
    with `checkpoint.enable=false`, the live recipe's publish settings with `publish.interval=0`."""
    from framework.resolve.resolver import resolve

    resolve("qwen35_35b_128k", ["checkpoint.enable=false"], for_training=False)  # its checkpoint.interval: 200
    resolve("debug_grpo_live", ["publish.interval=0"], for_training=False)  # its publish.dir, publish.keep


def test_an_adapter_that_loads_its_base_itself_keeps_load_path(workdir, clean_env):
    """adapter=lora loads checkpoint.load_path (its frozen base) at every launch, checkpointing on or off,
    resumed or not: neither refusal applies to it."""
    from framework.resolve.resolver import resolve
    from framework.resolve.resume import check_resume_load_path

    lora = ["adapter=lora", "moe.load_balance_coeff=null", "checkpoint.load_path=seed/step-0", "output_dir=run"]
    r = resolve(None, [*lora, "checkpoint.enable=false"], for_training=False)
    # a resume whose load_path differs from the run's launch (the check a launch makes after resume.check)
    check_resume_load_path(r.cfg, r.ctx, SimpleNamespace(changes=[("checkpoint.load_path", None, "seed/step-0")]))


def test_a_decay_cut_short_on_the_command_line_is_shortened_and_said(workdir, clean_env):
    """A recipe's lr.decay_ratio with training.steps cut short on the command line (a smoke test): the
    decay is shortened, as torchtitan does, and the run's first lines say so (not refused)."""
    from framework.resolve.resolver import resolve

    (workdir / "decay.yaml").write_text("defaults:\n  - debug_moe\n  - _self_\nlr:\n  decay_ratio: 0.9\n")
    r = resolve(str(workdir / "decay.yaml"), ["training.steps=5", "output_dir=run"], for_training=False)
    assert "lr: decay shortened to 3 steps (lr.decay_ratio=0.9 of training.steps=5 is 4 steps" in r.data_summary


def test_the_resume_command_a_seeded_run_prints_is_accepted(workdir, clean_env):
    """A run launched with checkpoint.load_path prints a resume command that repeats it: the same
    load_path as the run's launch is no conflict (only another one would be ignored)."""
    from omegaconf import OmegaConf

    from framework.resolve.resolver import resolve

    _step(workdir / "seed", 0)
    seeded = ["output_dir=run", "checkpoint.load_path=seed/checkpoint/step-0"]
    run = workdir / "run"
    run.mkdir()
    OmegaConf.save(resolve(None, [*seeded, "training.steps=2"], for_training=False).cfg, run / "config.yaml")
    _step(run, 2)
    r = resolve(None, [*seeded, "checkpoint.resume=true", "training.steps=4", "lr.total_steps=4"])
    assert r.resume_lines[0].startswith("resume: run/checkpoint/step-2 verified")
