"""Newcomer pass 10 (docs/newcomer_tenth_pass.md): a recipe file's `hydra:` section (output folders
that name a file: tests/test_bad_inputs_third_pass.py::test_apiary_output_folders_that_cannot_be_made_are_refused)."""

from conftest import run_cli


def test_a_recipe_files_hydra_section_is_refused(tmp_path):
    """`hydra: {run: {dir: x}, verbose: true}` in a recipe file was composed and silently unused (the same
    keys on the command line are refused): it is refused before anything runs, naming the file."""
    (tmp_path / "r5.yaml").write_text("defaults: [debug_moe, _self_]\nhydra:\n  run:\n    dir: hydra_here\n"
                                      "  verbose: true\n")
    for extra in ([], ["--cfg", "job"]):
        r = run_cli(["train", "recipe=r5.yaml", "training.steps=1", *extra], tmp_path)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "r5.yaml" in r.stderr and "`hydra:` section" in r.stderr and "output_dir=" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "hydra_here").exists() and not (tmp_path / "runs").exists()


def test_a_run_from_saved_weights_names_them(tmp_path, capsys):
    """A new run with checkpoint.load_path printed no line naming what it loaded (a resume names its step):
    it says which weights it starts from and what it does not take from them."""
    from conftest import train_here

    seed = train_here(["train", "checkpoint.create_seed=true", "output_dir=seed"], tmp_path, capsys)
    assert seed.returncode == 0, seed.stderr[-2000:]
    r = train_here(["train", "checkpoint.load_path=seed/checkpoint/step-0", "training.steps=1", "training.seq_len=64",
                    "output_dir=run"], tmp_path, capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next((x for x in r.stdout.splitlines() if x.startswith("weights: ")), "")
    assert str(tmp_path / "seed" / "checkpoint" / "step-0") in line and "fresh optimizer" in line, r.stdout[-2000:]
