"""A batch-script launch (launcher=slurm) from a machine that lacks the job's inputs (a login node
without the tokenizer folder, a hub dataset it cannot reach) still runs the memory preflight: the plan
needs none of those files, and a job that would die of OOM in step 1 must not be queued."""

from __future__ import annotations

import pytest


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_slurm_launch_missing_the_tokenizer_is_still_refused_for_memory(workdir, capsys):
    from toolkit.cli import apiary_main

    argv = ["launch", "recipe=qwen35_397b_256k", "launcher=slurm", "nodes=2", "gpus_per_node=8", "gpu=H100", "--dry-run"]
    assert apiary_main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "preflight.memory=refuse: the planner estimates" in err and "per GPU on H100" in err
    assert not (workdir / "runs").exists()  # nothing written, nothing submitted


def test_a_slurm_launch_that_fits_renders_with_a_warning_for_the_missing_tokenizer(workdir, capsys):
    from toolkit.cli import apiary_main

    argv = ["launch", "recipe=qwen3_30b_a3b_64k", "launcher=slurm", "nodes=2", "gpus_per_node=8", "--dry-run"]
    assert apiary_main(argv) == 0
    out = capsys.readouterr()
    assert "#SBATCH" in out.out and "does not exist on this machine" in " ".join(out.err.split())
