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
