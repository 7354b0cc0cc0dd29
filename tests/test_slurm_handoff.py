"""A Slurm job's ranks get the run `apiary launch` resolved at submit time, as local ranks do: the batch
script exports APIARY_RESOLVED (the run folder's resolved.yaml) and its SHA-256 for the ranks' command,
and a rank started that way loads it without composing the recipe again. A requeued job (a checkpoint
newer than the submission's) hands nothing over: its ranks resolve the resume themselves."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from framework.compose import recipes
from framework.resolve import resolver

ARGV = ["recipe=debug_moe", "launcher=slurm", "nodes=1", "gpus_per_node=2", "device=cpu", "training.steps=3",
        "output_dir=run"]


def _launch(capsys, argv):
    from toolkit.launch import launch_main

    code = launch_main(argv)
    cap = capsys.readouterr()
    return code, cap.out, " ".join(cap.err.split())


def _rank_side(script: str, output_dir: Path) -> tuple[str, str, list[str]]:
    """Run the script's resume and hand-off sections in bash: the APIARY_RESOLVED and its digest the
    ranks' command gets, and the `train` arguments it gets them with."""
    part = script[script.index("TRAIN_ARGS=("):script.index("# " + "-" * 64 + " preemption")]
    probe = (f"OUTPUT_DIR={output_dir}\nTOTAL_STEPS=3\n{part}\n"
             'printf "%s\\n" "${APIARY_RESOLVED:-unset}" "${APIARY_RESOLVED_SHA256:-unset}" "${TRAIN_ARGS[@]}"\n')
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()
    out = [x for x in out if not x.startswith("apiary:")]
    return out[0], out[1], out[2:]


def test_the_rendered_rank_command_names_the_handoff_file(capsys, workdir):
    code, script, err = _launch(capsys, [*ARGV, "--dry-run"])
    assert code == 0, err
    path, digest, args = _rank_side(script, workdir / "run")
    assert path == str(workdir / "run" / "resolved.yaml") and re.fullmatch(r"[0-9a-f]{64}", digest), (path, digest)
    assert args == ["recipe=debug_moe", "training.steps=3", f"output_dir={workdir / 'run'}"]
    # exported in the batch shell before srun starts the ranks' torchrun (srun and torchrun pass it on)
    srun = script.index('-m framework.train.preempt train "${TRAIN_ARGS[@]}"')
    assert script.index("export APIARY_RESOLVED=") < srun
    assert not (workdir / "run").exists()  # a dry run writes nothing


def test_a_submitted_jobs_ranks_load_the_handoff_and_compose_nothing(capsys, workdir, monkeypatch):
    from components.launchers import slurm
    from framework import cli
    from framework.launch import lifecycle

    submitted = []

    def sbatch(cmd, **kw):
        submitted.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="4242\n")

    monkeypatch.setattr(slurm, "subprocess", SimpleNamespace(run=sbatch, PIPE=subprocess.PIPE))
    monkeypatch.setattr(slurm, "shutil", SimpleNamespace(which=lambda name: f"/usr/bin/{name}"))
    code, out, err = _launch(capsys, ARGV)
    assert code == 0 and "submitted Slurm job 4242" in out, err
    run = workdir / "run"
    assert submitted == [["sbatch", "--parsable", str(run / "train.sbatch")]]
    script = (run / "train.sbatch").read_text()
    path, digest, args = _rank_side(script, run)
    assert Path(path).read_bytes() and hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest

    # a rank as torchrun starts it from that command: the hand-off is loaded, nothing composed or resolved
    def compose(*a, **k):
        raise AssertionError("a rank with a hand-off file composed the recipe")

    monkeypatch.setattr(recipes, "load", compose)
    monkeypatch.setattr(resolver, "resolve", compose)
    monkeypatch.setattr(cli, "resolve", compose)
    monkeypatch.setattr(lifecycle, "die_with_parent", lambda *a, **k: True)
    trained = []
    monkeypatch.setattr(cli.run, "train", lambda r, verbose=False: trained.append(r))
    for k, v in {"TORCHELASTIC_RUN_ID": "4242", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                 "LOCAL_WORLD_SIZE": "2", "APIARY_RESOLVED": path, "APIARY_RESOLVED_SHA256": digest}.items():
        monkeypatch.setenv(k, v)
    assert cli.train_main(args) == 0, capsys.readouterr().err
    assert len(trained) == 1 and trained[0].layout.world_size == 2 and trained[0].cfg.training.steps == 3
    assert trained[0].launch["overrides"][0] == "launcher=slurm"  # the submission's launch, for the resume line

    # requeued: a checkpoint the submission did not see; no hand-off, the ranks resolve the resume
    (run / "checkpoint" / "step-2").mkdir(parents=True)
    path, digest, args = _rank_side(script, run)
    assert (path, digest) == ("unset", "unset") and args[-1] == "checkpoint.resume=true"


@pytest.mark.parametrize("template", ["default", "own"])
def test_a_template_without_the_handoff_leaves_the_ranks_resolving(capsys, workdir, template):
    """A template copied before the hand-off existed still renders; its ranks resolve for themselves."""
    from components.launchers.slurm import TEMPLATE

    argv = [*ARGV, "--dry-run"]
    if template == "own":
        text = TEMPLATE.read_text()
        start = text.index("{% if handoff %}")
        (workdir / "old.sbatch.j2").write_text(text[:start] + text[text.index("{% endif %}", start) + 12:])
        argv.append("template=old.sbatch.j2")
    code, script, err = _launch(capsys, argv)
    assert code == 0, err
    assert ("export APIARY_RESOLVED=" in script) == (template == "default")
