"""Newcomer pass 9, checkpoints: what a model-only run's summary prints, a LoRA step given to
checkpoint.load_path, checkpoint.verify=false as one load's opt-in, and the warm-up note of a resume."""

import json
import shlex

import pytest
from omegaconf import OmegaConf

from framework.errors import UserError
from framework.report.resume_command import run_overrides
from framework.resolve import resume
from framework.train import integrity

from conftest import train_here


def _launch(run_dir, overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / resume.LAUNCHES).write_text(json.dumps({"recipe": "debug_moe", "overrides": overrides}) + "\n")


def test_checkpoint_verify_is_not_kept_by_a_resume_nor_printed(tmp_path):
    """checkpoint.verify=false given to one resume (a step without a manifest) is that load's opt-in: the next
    resume does not keep it, and the printed resume command does not carry it (was: kept, repeated, and a later
    resume loaded unverified)."""
    _launch(tmp_path, ["training.seq_len=64", "checkpoint.verify=false"])
    assert resume.kept_overrides(tmp_path, []) == ["training.seq_len=64"]
    assert run_overrides(resume.last_launch(tmp_path)) == ["training.seq_len=64"]


def _cfg(warmup, steps=10):
    return {"lr": {"warmup_steps": warmup, "total_steps": None, "decay_ratio": None, "decay_type": "linear",
                   "min_lr_factor": 0.0}, "training": {"steps": steps}}


def test_a_warmup_change_not_shortened_gets_no_shortening_note(tmp_path):
    """lr.warmup_steps 2 then, 3 now, neither shortened: the refusal names the change only (was: a note on a
    shortening that never happened)."""
    OmegaConf.save(OmegaConf.create(_cfg(2)), tmp_path / resume.FIRST)
    with pytest.raises(UserError) as e:
        resume.check(OmegaConf.create(_cfg(3)), tmp_path, 5)
    msg = str(e.value)
    assert "lr.warmup_steps: 2 then, 3 now" in msg and "shortened" not in msg


def test_a_shortened_warmup_keeps_its_note(tmp_path):
    OmegaConf.save(OmegaConf.create(_cfg(20, steps=4)), tmp_path / resume.FIRST)  # shortened to 3
    with pytest.raises(UserError) as e:
        resume.check(OmegaConf.create(_cfg(5)), tmp_path, 4)
    msg = str(e.value)
    assert "lr.warmup_steps: 3 then, 5 now" in msg and "shortened" in msg and "lr.warmup_steps=3 keeps it" in msg


# ------------------------------------------- a run whose only step holds the model (checkpoint.model_only_last)
SMALL = ["recipe=debug_moe", "training.seq_len=64", "model.n_layers=1", "training.steps=2",
         "checkpoint.model_only_last=true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of 2 steps whose one save (step 2) is model-only: plain, and LoRA (on the seeded base)."""
    root = tmp_path_factory.mktemp("pass9")
    for name, extra in (("mo", []), ("lmo", ["adapter=lora"])):
        p = train_here(["train", *SMALL, *extra, f"output_dir={name}"], root)
        assert p.returncode == 0, p.stderr[-3000:]
    return root


def test_summary_of_a_model_only_run_prints_a_new_run_not_a_resume(runs, capsys):
    """No full step: the summary prints the new run from the weights, which runs (was: a resume command, whose
    run exited 2: `holds the model's weights only ... No full step exists to resume from`)."""
    s = json.loads((runs / "mo" / "summary.json").read_text())
    assert "resume" not in s["next"] and "checkpoint.resume=true" not in json.dumps(s["next"])
    printed = s["next"]["new run"]
    assert "checkpoint.load_path=mo/checkpoint/step-2" in printed
    argv = [a if not a.startswith("training.steps=") else "training.steps=1" for a in shlex.split(printed)]
    p = train_here(argv, runs, capsys)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert (runs / "mo-from-step-2" / "metrics.jsonl").is_file()
    # pass 11: the line repeats the launch's training.steps=2 (was: dropped), and the new run's own new-run line
    # names a folder of the first run's name, not a chain (was: mo-from-step-2-from-step-1)
    assert "training.steps=2" in shlex.split(printed)
    again = json.loads((runs / "mo-from-step-2" / "summary.json").read_text())["next"]["new run"]
    assert "output_dir=mo-from-step-1" in again and "training.steps=1" in shlex.split(again), again


def test_summary_of_a_model_only_lora_run_prints_the_merged_export(runs):
    s = json.loads((runs / "lmo" / "summary.json").read_text())
    assert "resume" not in s["next"]
    # a seeded base, which apiary export refuses: no export command, why (tests/test_newcomer_pass10.py)
    assert "exists on no disk" in s["next"]["new run"] and "--merged" not in s["next"]["new run"]


# ------------------------------------------- checkpoint.load_path naming a LoRA run's step
def test_load_path_naming_a_lora_step_is_refused_before_launch(runs, capsys):
    """Was: a DCP traceback in the worker, `Missing key in checkpoint state_dict: layers.0.attention.k_norm.weight`."""
    step = runs / "lmo" / "checkpoint" / "step-2"
    for extra in ([], ["adapter=lora"]):
        p = train_here(["train", *SMALL[:3], "training.steps=1", *extra, f"checkpoint.load_path={step}",
                        "output_dir=lp"], runs, capsys)
        out = p.stdout + p.stderr
        assert p.returncode == 2, out[-3000:]
        assert "adapter=lora" in out and "exists on no disk" in out and "model.hf_checkpoint=" in out
        assert "Traceback" not in out and not (runs / "lp" / "metrics.jsonl").exists()


def test_model_only_lora_step_refusal_names_the_merged_export(runs):
    """A resume of a LoRA run's model-only step named checkpoint.load_path=STEP as the way on, itself a crash."""
    with pytest.raises(UserError) as e:
        integrity.check_resume(runs / "lmo", None, "checkpoint.resume=true")
    msg = str(e.value)
    assert "weights only" in msg and "exists on no disk" in msg and "model.hf_checkpoint=" in msg
    assert "checkpoint.resume=true)" not in msg  # no resume of the run whose resume this refuses
    assert "checkpoint.load_path=" + str(runs / "lmo" / "checkpoint" / "step-2") not in msg
