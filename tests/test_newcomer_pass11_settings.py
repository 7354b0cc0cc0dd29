"""Newcomer pass 11 (docs/newcomer_eleventh_pass.md), settings: a key typed twice with two values is refused
(#6); the exit-76 paragraph calls no checkpoint good whose next step was non-finite, and a launch with
optimizer.lr above 1 says to expect that (#13); state.offload_threads without state.offload=optimizer is
refused (#18); an unknown recipe= name with NAME.yaml in this folder names that file (#23); `apiary show
X.yaml` away from the file names `apiary show` forms, not `train recipe=` ones (#49)."""

import shutil

from conftest import ROOT, run_cli, train_here

TINY = ["recipe=debug_moe", "training.seq_len=64", "model.n_layers=1"]


# -- #6: one value per key on a command line ------------------------------------------------------
def test_a_key_typed_twice_with_two_values_is_refused(workdir, capsys):
    p = train_here(["train", "recipe=debug_moe", "training.steps=100", "loss=chunked", "training.steps=6",
                    "--cfg", "job"], workdir, capsys)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert ("override training.steps: is given twice, as training.steps=100 and as training.steps=6" in p.stderr
            and "Give training.steps once" in p.stderr), p.stderr
    for argv, needle in ((["+training.steps=6", "training.steps=7"], "as +training.steps=6 and as training.steps=7"),
                         (["loss=chunked", "loss=ce"], "as loss=chunked and as loss=ce"),
                         (["recipe=debug_dense"], "as recipe=debug_moe and as recipe=debug_dense")):
        p = train_here(["train", "recipe=debug_moe", *argv, "--cfg", "job"], workdir, capsys)
        assert p.returncode == 2 and needle in p.stderr, (argv, p.stderr)
    p = train_here(["train", "recipe=debug_moe", "training.steps=6", "+training.steps=6", "recipe=debug_moe",
                    "--cfg", "job"], workdir, capsys)  # the same value twice: one setting
    assert p.returncode == 0 and "steps: 6" in p.stdout, p.stderr[-2000:]


def test_a_resume_gives_a_kept_key_a_new_value(workdir, capsys):
    """Only one command line counts: the last launch's training.steps=2, kept by a resume, gives way to the
    training.steps=3 typed now."""
    run = [*TINY, "checkpoint.interval=2", "logging.tensorboard=false", "output_dir=run"]
    p = train_here(["train", *run, "training.steps=2", "lr.total_steps=4"], workdir, capsys)
    assert p.returncode == 0, p.stderr[-2000:]
    p = train_here(["train", *run, "training.steps=3", "checkpoint.resume=true"], workdir, capsys)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "given twice" not in p.stderr and "step     3/3" in p.stdout, p.stdout[-2000:]


# -- #13: a checkpoint whose next step was not finite is not called good ----------------------------
def test_a_checkpoint_before_a_non_finite_step_is_not_called_good(workdir, capsys):
    """troubleshooting.md's exit-76 case: step 1's update at a huge lr leaves finite but ruined weights,
    step-2 is saved during the skipped steps (was: `Last good checkpoint: step-2`, whose resume at a sane
    lr stopped again at once)."""
    p = train_here(["train", *TINY, "optimizer.lr=1e30", "training.steps=6", "checkpoint.interval=2",
                    "training.on_nonfinite=skip", "training.max_skips=2", "logging.tensorboard=false",
                    "output_dir=nan"], workdir, capsys)
    assert p.returncode == 76, p.stdout[-2000:] + p.stderr[-3000:]
    assert "optimizer: lr=1e+30 is above 1" in p.stdout, p.stdout[:3000]  # said at launch
    assert (workdir / "nan" / "checkpoint" / "step-2").is_dir()
    assert "Last good checkpoint" not in p.stderr, p.stderr[-3000:]
    assert "No good checkpoint to name: step 3, computed from the weights of the newest, step-2" in p.stderr
    assert "none was saved before that: run it again from the start (a new output_dir)" in p.stderr


def test_the_restart_hint_names_the_last_checkpoint_before_a_non_finite_step(tmp_path):
    from framework.train import integrity

    ck = tmp_path / "checkpoint"
    for step in (2, 4):
        (ck / f"step-{step}").mkdir(parents=True)
        integrity.write_manifest(ck / f"step-{step}", step, {})
    hint = integrity.restart_hint(ck, "`train output_dir=x checkpoint.resume=true`", {5, 6})
    assert "the newest, step-4" in hint and "may be damaged" in hint
    assert hint.endswith("The last one saved before: step-2. Resume from it with "
                         "`train output_dir=x checkpoint.resume=true checkpoint.load_step=2`"), hint
    assert integrity.restart_hint(ck, "", {3}).startswith("Last good checkpoint: step-4")  # step 5 was finite
    p = run_cli(["train", *TINY, "optimizer.lr=1", "training.steps=1", "checkpoint.enable=false", "output_dir=r"],
                cwd=tmp_path)  # a sane lr says nothing at launch
    assert p.returncode == 0 and "is above 1" not in p.stdout + p.stderr


# -- #18: state.offload_threads only with state.offload=optimizer -----------------------------------
def test_offload_threads_without_the_host_update_is_refused(workdir, capsys):
    for state in ("fsdp2", "zero1"):
        p = train_here(["train", f"state={state}", "state.offload_threads=2", "training.steps=2", "--cfg", "job"],
                       workdir, capsys)
        assert p.returncode == 2, p.stdout[-2000:]
        assert ("state.offload_threads=2 sets the CPU threads of the host optimizer update of state.offload=optimizer, "
                "but this run has state.offload=none" in p.stderr and "drop state.offload_threads" in p.stderr), p.stderr
    p = train_here(["train", "state.offload=optimizer", "state.offload_threads=2", "--cfg", "job"], workdir, capsys)
    assert p.returncode == 0, p.stderr[-2000:]


# -- #23 and #49: a recipe file beside the command, in the command's own words -----------------------
def test_an_unknown_recipe_name_with_its_file_here_names_the_file(workdir, capsys):
    shutil.copy(ROOT / "recipes" / "debug_moe.yaml", workdir / "my_recipe.yaml")
    p = train_here(["train", "recipe=my_recipe", "--cfg", "job"], workdir, capsys)
    assert p.returncode == 2 and "unknown recipe 'my_recipe'" in p.stderr
    assert "Did you mean recipe=my_recipe.yaml (a file in this folder)?" in p.stderr, p.stderr
    p = run_cli(["apiary", "show", "my_recipe"], cwd=workdir)
    assert p.returncode == 2 and "Did you mean `apiary show my_recipe.yaml` (a file in this folder)?" in p.stderr, \
        p.stderr


def test_apiary_show_of_a_missing_file_names_apiary_show(workdir):
    p = run_cli(["apiary", "show", "qwen35_debug_moe.yaml"], cwd=workdir)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "apiary show qwen35_debug_moe.yaml: no recipe file at qwen35_debug_moe.yaml" in p.stderr, p.stderr
    assert "Write `apiary show qwen35_debug_moe`, or copy it here" in p.stderr and "recipe=" not in p.stderr, p.stderr
