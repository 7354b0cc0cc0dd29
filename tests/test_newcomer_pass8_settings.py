"""Newcomer pass 8, settings that were accepted and ignored: Hydra's own keys on a run without -m,
checkpoint.verify with nothing to load, moe.* keys on a dense model, `apiary plan` flags without --search,
a misspelt build_model override, and recompute=auto's budget on a CPU run."""

import os
import subprocess
import sys
import textwrap

import pytest

from framework.cli import train_main

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
