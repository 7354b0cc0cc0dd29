"""Newcomer pass 10: what apiary says for a LoRA step on a seeded base, a resume without recipe= of another
recipe's run, and an lr.total_steps kept from the last launch."""


import json

from omegaconf import OmegaConf

from framework.report.resume_command import from_weights

from conftest import train_here


# ---- h-j: seeded-base adapters, a resume's recipe, kept lr.total_steps
def _seeded_lora_run(root, hf=None):
    run = root / "runs" / "lora"
    (run / "checkpoint" / "step-2").mkdir(parents=True)
    (run / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")
    OmegaConf.save(OmegaConf.create({"recipe": "debug_moe", "adapter": {"name": "lora"},
                                     "model": {"family": "qwen3", "flavor": "tiny_moe", "hf_checkpoint": hf},
                                     "checkpoint": {"load_path": None}, "training": {"seed": 42}}), run / "config.yaml")
    return run


def test_a_seeded_lora_step_as_load_path_is_not_sent_to_a_refused_export(workdir, capsys):
    """checkpoint.load_path=STEP of a LoRA run on the seeded base: refused, naming the base that exists on no
    disk and what works (was: told to run apiary export --merged, which itself exits 2 for that base)."""
    run = _seeded_lora_run(workdir)
    r = train_here(["train", f"checkpoint.load_path={run}/checkpoint/step-2", "training.steps=1",
                    "training.seq_len=64"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, err
    assert "--merged" not in err and "apiary export" in err, err
    assert "initialised from training.seed=42 (qwen3 tiny_moe), a base that exists on no disk" in err, err
    assert f"output_dir={run} checkpoint.resume=true" in err and "model.hf_checkpoint=DIR" in err, err


def test_the_summarys_new_run_line_of_a_seeded_lora_run_names_no_export(tmp_path):
    """The summary's new-run line for a LoRA run on the seeded base says why none exists (was: an apiary export
    --merged command that exits 2); a LoRA run on a base folder keeps its export-then-train command."""
    run = _seeded_lora_run(tmp_path)
    line = from_weights(run / "checkpoint" / "step-2", "debug_moe", str(run), [], str)
    assert line.startswith("none: ") and "exists on no disk" in line and "--merged" not in line, line
    other = _seeded_lora_run(tmp_path / "b", hf="/models/base")
    assert "--merged --step 2, then train" in from_weights(other / "checkpoint" / "step-2", "debug_moe", str(other), [], str)


def test_a_resume_without_recipe_resumes_the_runs_own_recipe(workdir, capsys):
    """checkpoint.resume=true of a debug_grpo run, no recipe= given: the run's recipe (its last launch's) is
    resumed, its kept overrides on it (was: exit 2, `override loss.kl_coef=1e-3: unknown key 'loss.kl_coef'
    for recipe debug_moe`, an override the user never typed applied to the default recipe)."""
    run = workdir / "runs" / "kl"
    run.mkdir(parents=True)
    (run / "launches.jsonl").write_text(json.dumps({"recipe": "debug_grpo", "overrides": ["loss.kl_coef=0"]}) + "\n")
    r = train_here(["train", "output_dir=runs/kl", "checkpoint.resume=true"], workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, err
    assert "unknown key" not in err and "debug_moe" not in err, err
    assert "holds no checkpoint" in err, err  # composed as debug_grpo, then refused for its empty folder


def test_a_kept_lr_total_steps_is_named_as_kept_in_the_tail_refusal(workdir, capsys):
    """A resume whose lr.total_steps=4 was kept from the last launch and whose training.steps fell back to the
    recipe's 20: the refusal says the 4 was kept and the 20 is the recipe's (was: both shown as if typed)."""
    run = workdir / "runs" / "mine"
    run.mkdir(parents=True)
    (run / "launches.jsonl").write_text(json.dumps({"recipe": "debug_moe", "overrides": ["lr.total_steps=4"]}) + "\n")
    r = train_here(["train", "recipe=debug_moe", "output_dir=runs/mine", "checkpoint.resume=true", "training.seed=7"],
                   workdir, capsys)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, err
    assert "lr.total_steps=4 (kept from the run's last launch, not typed now)" in err, err
    assert "training.steps=20 (the recipe's) would train nothing" in err, err
