"""Newcomer pass 8, settings that were accepted and ignored: Hydra's own keys on a run without -m,
checkpoint.verify with nothing to load, moe.* keys on a dense model, `apiary plan` flags without --search,
a misspelt build_model override, and recompute=auto's budget on a CPU run."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from framework import devices
from framework.api import build_model
from framework.cli import train_main
from framework.compose import registry
from framework.compose.schema import MoEConfig
from framework.errors import UserError
from framework.resolve.resolver import resolve
from toolkit.cli import apiary_main

from conftest import ROOT


def _err(capsys, argv, main=train_main):
    code = main(argv)
    return code, " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------- 1. hydra.* without effect
@pytest.mark.parametrize("override, says", [
    ("hydra.sweep.subdir=x", "places the jobs of a -m sweep"),
    ("hydra.sweep.dir=x", "places the jobs of a -m sweep"),
    ("hydra.job.chdir=true", "changing directory is not supported"),
    ("hydra/job_logging=disabled", "does not use Hydra's logging configuration"),
    ("hydra/hydra_logging=disabled", "does not use Hydra's logging configuration"),
    ("hydra.verbose=true", "Hydra's settings (hydra.*) would be ignored"),
])
def test_hydra_keys_without_effect_on_a_run_are_refused(capsys, workdir, override, says):
    """Each was: exit 0, the run trained, the setting did nothing."""
    code, err = _err(capsys, [override, "training.steps=1"])
    assert code == 2 and f"override {override}" in err and says in err, err
    assert not (workdir / "runs").exists()


def test_hydra_run_dir_keeps_its_own_fix(capsys, workdir):
    code, err = _err(capsys, ["hydra.run.dir=out"])
    assert code == 2 and "Set output_dir=out instead" in err, err


@pytest.mark.parametrize("override", ["hydra.job.chdir=true", "hydra/job_logging=disabled"])
def test_hydra_chdir_and_logging_refused_in_a_sweep_too(capsys, workdir, override):
    code, err = _err(capsys, ["-m", "training.steps=1,2", override])
    assert code == 2 and f"override {override}" in err, err
    assert not (workdir / "runs").exists()


def test_sweep_dir_and_subdir_still_place_a_sweeps_jobs(workdir):
    script = textwrap.dedent("""
        import sys
        from pathlib import Path
        from framework import cli

        def job(recipe, job, output_dir, verbose):
            Path(output_dir, "ran").write_text(" ".join(job))
            return 0

        cli._run_job = job
        sys.exit(cli.train_main(["-m", "training.steps=1,3", "hydra.sweep.dir=sw",
                                 "hydra.sweep.subdir=s${hydra.job.num}"]))
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=workdir, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "training.steps=1" in (workdir / "sw" / "s0" / "ran").read_text()
    assert "training.steps=3" in (workdir / "sw" / "s1" / "ran").read_text()


def test_cfg_hydra_still_shows_a_given_sweep_dir(capsys, workdir):
    assert train_main(["--cfg", "hydra", "-p", "hydra.sweep", "hydra.sweep.subdir=x"]) == 0
    assert "subdir: x" in capsys.readouterr().out


# ---------------------------------------------------------------- 2. checkpoint.verify with nothing to load
@pytest.mark.parametrize("value", ["false", "true"])
def test_checkpoint_verify_on_a_fresh_run_is_refused(capsys, workdir, value):
    """Was: exit 0 for checkpoint.verify=false on a run that loads nothing (load_step was already refused)."""
    code, err = _err(capsys, [f"checkpoint.verify={value}", "--cfg", "job"])
    assert code == 2 and "checkpoint.verify=" in err and "checkpoint.resume=true or checkpoint.load_path" in err, err


# ---------------------------------------------------------------- 3. moe.* on a dense model
def _non_default(field):
    default = field.default if field.default is not dataclasses.MISSING else None
    if field.name in ("comm", "chunk"):
        return next(n for n in registry.names(f"moe_{field.name}") if n != default)
    if isinstance(default, bool) or default is None and "bool" in str(field.type):
        return str(not default).lower()
    if isinstance(default, float) or default is None:
        return "0.05"
    raise AssertionError(f"moe.{field.name}: give the test a non-default value for {field.type}")


@pytest.mark.parametrize("field", dataclasses.fields(MoEConfig), ids=lambda f: f.name)  # a new key is tested too
def test_every_moe_key_on_a_dense_model_is_refused(capsys, workdir, field):
    """Was: moe.lean_combine=true on debug_dense exit 0 (only chunk, comm, load_balance_coeff were refused)."""
    override = f"moe.{field.name}={_non_default(field)}"
    code, err = _err(capsys, ["recipe=debug_dense", override, "--cfg", "job"])
    assert code == 2 and f"moe.{field.name}=" in err, (override, err)


def test_moe_lean_combine_on_a_dense_model_names_the_dense_model(capsys, workdir):
    code, err = _err(capsys, ["recipe=debug_dense", "moe.lean_combine=true", "--cfg", "job"])
    assert code == 2 and "is a dense model: it has no MoE layers" in err, err


def test_moe_keys_on_an_moe_model_are_still_accepted(capsys, workdir):
    assert train_main(["recipe=debug_moe", "moe.lean_combine=false", "moe.load_balance_coeff=0.01",
                       "--cfg", "job", "-p", "moe"]) == 0
    assert "lean_combine: false" in capsys.readouterr().out


# ---------------------------------------------------------------- 4. apiary plan flags that act only with another
@pytest.mark.parametrize("argv, says", [
    (["recipe=debug_moe", "gpus=8", "--top=2"], "--top=2: picks how many rows --search shows"),
    (["--constants", "--json"], "--constants with --json"),
    (["--constants", "--search"], "--constants with --search"),
    (["--constants", "gpus=8"], "--constants with gpus=8"),
])
def test_plan_flag_without_the_flag_it_needs_is_refused(capsys, argv, says):
    """Was: exit 0, `--top` without --search (and --constants with anything) silently ignored."""
    code, err = _err(capsys, ["plan", *argv], apiary_main)
    assert code == 2 and says in err, err


def test_plan_top_with_search_still_ranks(capsys):
    assert apiary_main(["plan", "recipe=debug_moe", "gpus=2", "--search", "--top=1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["search"]) == 1


# ---------------------------------------------------------------- 5. build_model with a misspelt setting
def test_build_model_misspelt_setting_suggests_the_close_one():
    """Was: `... model_config() got an unexpected keyword argument 'n_layer'. Drop the override (e.g.
    hf_checkpoint) for this family.`: no did-you-mean, and an unrelated example."""
    with pytest.raises(UserError) as e:
        build_model("debug_moe", n_layer=2)
    msg = str(e.value)
    assert "Did you mean 'n_layers'?" in msg and "no model setting 'n_layer'" in msg, msg
    assert "hf_checkpoint) for this family" not in msg
    with pytest.raises(UserError) as e:
        build_model("debug_moe", zzz=1)
    assert "Drop zzz=." in str(e.value) and "n_layers" in str(e.value)


# ---------------------------------------------------------------- 6. recompute=auto's budget on a CPU run
def test_recompute_budget_on_a_cpu_run_counts_no_gpu_overheads(workdir, monkeypatch):
    """Was: `planned 2.5 GiB (torch reserved 0.0 + CUDA context and NCCL 2.5) of 0.0 GiB ... does not fit on
    H100 (recompute.budget_gib)`: a CPU run planned as an H100 with its CUDA context."""
    monkeypatch.setattr(devices, "has_accelerator", lambda: False)
    r = resolve("debug_moe", ["recompute=auto", "recompute.budget_gib=0.001", "output_dir=run"], for_training=True)
    reason = r.ctx.derived["recompute"]["reason"]
    assert "H100" not in reason and "H200" not in reason and "CUDA context and NCCL 2" not in reason, reason
    assert "on this CPU run (recompute.budget_gib; no CUDA context or NCCL counted)" in reason, reason
    assert "of 0.001 GiB" in reason, reason
    r = resolve("debug_moe", ["recompute=auto", "recompute.budget_gib=4", "output_dir=run2"], for_training=True)
    blocks = r.ctx.derived["recompute"]["blocks"]  # 4 GiB without the 2.5 GiB reserve: every block kept
    assert all(not v.get("recomputed") for v in blocks.values()), blocks
