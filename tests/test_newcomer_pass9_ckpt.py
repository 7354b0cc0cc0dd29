"""Newcomer pass 9, checkpoints: what a model-only run's summary prints, a LoRA step given to
checkpoint.load_path, checkpoint.verify=false as one load's opt-in, and the warm-up note of a resume."""

import json

import pytest
from omegaconf import OmegaConf

from framework.errors import UserError
from framework.report.resume_command import run_overrides
from framework.resolve import resume


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
