"""Newcomer pass 11, resumes: a run launched with relative paths (data, a user registry, a recipe file) resumed
from another folder; an exit 77 before any step trained says to run again without checkpoint.resume; a resume
without output_dir after a sweep names the sweep's job folders; a resume on another number of ranks names the
run's nproc=N; the recipe's training.steps in a schedule refusal is named as the recipe's, not as typed."""

import json

import pytest
from omegaconf import OmegaConf

from framework.compose import registry
from framework.resolve import resume
from framework.resolve.resolver import resolve
from framework.train import integrity

from conftest import ROOT, train_here

TINY = ["training.seq_len=64", "model.n_layers=1"]
DOC = "the quick brown fox jumps over the lazy dog. " * 4


def _run_folder(run, cfg, overrides, step, cwd=None):
    """A run folder as a launch leaves it (config.yaml, launches.jsonl) with one complete full checkpoint step."""
    step_dir = run / "checkpoint" / f"step-{step}"
    step_dir.mkdir(parents=True)
    (step_dir / ".metadata").write_bytes(b"train_state")  # a full save's DCP metadata names train_state
    integrity.write_manifest(step_dir, step, integrity.entries(step_dir, [".metadata"]))
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    launch = {"recipe": "debug_moe", "overrides": overrides, **({"cwd": str(cwd)} if cwd else {})}
    (run / resume.LAUNCHES).write_text(json.dumps(launch) + "\n")
    return run


# ---- #38: kept relative paths are the launch folder's
def test_a_run_with_a_relative_data_path_resumes_from_another_folder(tmp_path, monkeypatch, capsys):
    """`cd A && train data.path=my.jsonl output_dir=runs/mine`, then from B `train output_dir=A/runs/mine
    checkpoint.resume=true ...`: the kept data.path is A's file (was: exit 2, `data.path=my.jsonl` read again in B,
    a file the user never named there). launches.jsonl records the launch's folder; a line of an older apiary
    (no cwd) is resolved as the launch's config holds it."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "my.jsonl").write_text("".join(json.dumps({"text": DOC}) + "\n" for _ in range(8)))
    r = train_here(["train", "recipe=debug_moe", *TINY, "training.steps=2", "data.path=my.jsonl", "output_dir=runs/mine"],
                   a, capsys)
    assert r.returncode == 0, r.stderr[-3000:]
    run = a / "runs" / "mine"
    assert json.loads((run / resume.LAUNCHES).read_text().splitlines()[-1])["cwd"] == str(a)
    r = train_here(["train", f"output_dir={run}", "checkpoint.resume=true", "training.steps=3", "lr.total_steps=3"],
                   b, capsys)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "keeps the last launch's overrides" in r.stdout + r.stderr and f"data.path={a / 'my.jsonl'}" in r.stdout + r.stderr
    # an older apiary's line: relative, no cwd -> the absolute path config.resume-1.yaml holds
    (run / resume.LAUNCHES).write_text(json.dumps({"recipe": "debug_moe", "overrides": [
        *TINY, "lr.warmup_steps=1", "data.path=my.jsonl"]}) + "\n")
    r = train_here(["train", f"output_dir={run}", "checkpoint.resume=true", "training.steps=4", "lr.total_steps=4"],
                   b, capsys)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(integrity.complete_steps(run / "checkpoint"))[-1] == 4


def test_a_kept_registry_recipe_file_and_hf_folder_are_the_launch_folders(tmp_path, monkeypatch, capsys):
    """`cd A && train registry=reg.yaml loss=my_ce ...`, resumed from B: the user registry is A's file (was:
    `registry=reg.yaml: no user registry file at B/reg.yaml`); a relative recipe file and model.hf_checkpoint
    likewise; names (data.tokenizer=byte) and absolute paths are kept as given."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "reg.yaml").write_text("loss:\n  my_ce:\n    target: components.losses.ce:CrossEntropy\n    doc: a user's ce\n")
    (a / "my.yaml").write_text("defaults:\n  - debug_moe\n")
    run = a / "run"
    run.mkdir()
    (run / resume.LAUNCHES).write_text(json.dumps({"recipe": "my.yaml", "cwd": str(a), "overrides": [
        "registry=reg.yaml", "loss=my_ce", "model.hf_checkpoint=../a/my_model", "data.tokenizer=byte",
        "publish.dir=/abs/w", "training.steps=3"]}) + "\n")
    monkeypatch.chdir(b)
    kept, recipe = resume.kept_launch(run, ["checkpoint.resume=true"], None)
    assert recipe == str(a / "my.yaml")
    assert kept == [f"registry={a / 'reg.yaml'}", "loss=my_ce", f"model.hf_checkpoint={a / 'my_model'}",
                    "data.tokenizer=byte", "publish.dir=/abs/w"]
    # the whole resume from B: the registry is read (the refusal is the folder's missing checkpoint)
    (run / resume.LAUNCHES).write_text(json.dumps({"recipe": "debug_moe", "cwd": str(a), "overrides": [
        "registry=reg.yaml", "loss=my_ce", "training.steps=3"]}) + "\n")
    monkeypatch.setitem(registry.entries(), "loss", dict(registry.entries()["loss"]))
    monkeypatch.setattr(registry, "_USED", list(registry._USED))
    r = train_here(["train", f"output_dir={run}", "checkpoint.resume=true"], b, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, err
    assert "no user registry file" not in err and "holds no checkpoint" in err, err


# ---- #14: exit 77 before any step trained
def test_a_fresh_live_run_that_times_out_says_to_run_again_without_resume(tmp_path, capsys):
    """No rollouts on a fresh run: exit 77 says there is nothing to resume and to run the same command again
    without checkpoint.resume (was: "the rollout position of step 0 is kept", and troubleshooting.md said to resume,
    which is refused: `holds no checkpoint`); the page says so too."""
    (tmp_path / "rollouts").mkdir()
    r = train_here(["train", "recipe=debug_grpo_live", "data.path=rollouts", "publish.dir=weights",
                    "data.wait_timeout=1", "output_dir=run"], tmp_path, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 77, err[-3000:]
    assert "no checkpoint was written (no step trained), so there is nothing to resume: run the same command again " \
           "without checkpoint.resume once the generator writes" in err, err[-3000:]
    assert "rollout position of step 0" not in err, err[-3000:]
    page = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split("## Exit code 77")[1].split("##")[0].split())
    assert "run the same command again without `checkpoint.resume`" in page, page


# ---- #29: a resume without output_dir after a sweep
def test_a_resume_after_a_sweep_names_its_job_folders(workdir, capsys):
    """`train -m ...` then `train checkpoint.resume=true`: the refusal names the sweep's job folders as output_dir=
    choices (was: "no earlier run ... under runs/debug_moe/" with checkpoints in runs/debug_moe/multirun-*/N)."""
    sweep = workdir / "runs" / "debug_moe" / "multirun-20250101-000000"
    for n in (0, 1):
        (sweep / str(n) / "checkpoint" / "step-3").mkdir(parents=True)
        (sweep / str(n) / "checkpoint" / "step-3" / ".metadata").write_bytes(b"train_state")
    (sweep / "multirun.yaml").write_text("{}\n")
    r = train_here(["train", "checkpoint.resume=true", "training.steps=6", "lr.total_steps=6"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, err
    assert "a sweep's jobs are in its multirun-* folders" in err, err
    assert ("output_dir=runs/debug_moe/multirun-20250101-000000/0, output_dir=runs/debug_moe/multirun-20250101-000000/1"
            in err), err


# ---- #39 and #47: what a resume's refusal names that the user did not type
@pytest.fixture(scope="module")
def two_rank_config():
    return resolve("debug_moe", [*TINY, "training.steps=4", "launcher.nproc=2"], world_size=2, for_training=False).cfg


def test_a_two_rank_run_resumed_on_one_names_nproc(workdir, capsys, two_rank_config):
    """A 2-rank run resumed with nproc=1: the refusal says the degrees follow the ranks and names nproc=2 as the
    fix (was: only `parallel.dp_shard: 2 then, 1 now; parallel.ep: 2 then, 1 now` and "Resume with the old values",
    keys the user never typed)."""
    assert two_rank_config.parallel.dp_shard == 2, OmegaConf.to_yaml(two_rank_config.parallel)
    run = _run_folder(workdir / "np2b", two_rank_config, [*TINY, "launcher.nproc=2", "training.steps=4"], 4, cwd=workdir)
    r = train_here(["train", f"output_dir={run}", "checkpoint.resume=true", "nproc=1", "training.steps=6",
                    "lr.total_steps=6"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, err
    assert "parallel.dp_shard: 2 then, 1 now" in err, err
    assert "the run was trained on 2, this launch starts 1" in err, err
    assert "Resume with the old values (nproc=2 starts the run's 2 ranks again)" in err, err


def test_the_recipes_training_steps_is_named_as_the_recipes_in_a_schedule_refusal(workdir, capsys):
    """A finished 4-step run resumed with no training.steps: the refusal names training.steps=20 as the recipe's
    and says the last launch's 4 is not kept (was: `checkpoint.resume=true training.steps=20:` as if typed)."""
    cfg = resolve("debug_moe", [*TINY, "training.steps=4"], world_size=1, for_training=False).cfg
    run = _run_folder(workdir / "np2c", cfg, [*TINY, "training.steps=4"], 4, cwd=workdir)
    r = train_here(["train", f"output_dir={run}", "checkpoint.resume=true"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, err
    assert "checkpoint.resume=true training.steps=20 (the recipe's; the last launch's 4 is not kept): the learning-rate" \
           in err, err
    r = train_here(["train", f"output_dir={run}", "checkpoint.resume=true", "training.steps=20"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "checkpoint.resume=true training.steps=20: the learning-rate" in err, err
