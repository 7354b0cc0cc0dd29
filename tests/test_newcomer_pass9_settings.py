"""Newcomer pass 9, settings that were accepted and ignored: no-effect keys set in a user's recipe file,
Hydra's own keys under --cfg job, autotune_configs on a CPU run, and an option several loss names own."""

import textwrap

import pytest

from framework import devices
from framework.cli import train_main
from framework.compose.recipe_files import recipe_names
from framework.resolve.resolver import resolve
from toolkit.cli import apiary_main


def _err(capsys, argv, main=train_main):
    code = main(argv)
    return code, " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------- 4. every owner of an option is named
@pytest.mark.parametrize("override", ["loss.z_loss=1e-4", "+loss.z_loss=1e-4"])
def test_an_option_several_loss_names_own_names_them_all(capsys, workdir, override):
    """Was: only loss=linear_ce was suggested, though loss=ce_zloss takes z_loss too."""
    code, err = _err(capsys, ["loss=ce", override, "--cfg", "job"])
    assert code == 2, err
    assert "an option of loss=linear_ce and loss=ce_zloss" in err, err
    assert "write loss=linear_ce loss.z_loss=1e-4 or loss=ce_zloss loss.z_loss=1e-4" in err, err


# ---------------------------------------------------------------- 1. no-effect keys set in a user's recipe file
def _recipe(workdir, name, text):
    (workdir / "rc").mkdir(exist_ok=True)
    (workdir / "rc" / name).write_text(textwrap.dedent(text))
    return f"recipe=rc/{name}"


def test_moe_key_in_a_users_dense_recipe_file_is_refused(capsys, workdir):
    """Was: exit 0, trained, moe.lean_combine ignored (the same key on the command line exits 2)."""
    recipe = _recipe(workdir, "dn.yaml", "defaults: [debug_dense, _self_]\nmoe: {lean_combine: true}\n")
    code, err = _err(capsys, [recipe, "--cfg", "job"])
    assert code == 2 and "moe.lean_combine=True (set in recipe file" in err and "dn.yaml" in err, err
    assert "is a dense model" in err and "Drop moe.lean_combine from" in err, err


@pytest.mark.parametrize("extra, key", [([], "training.max_skips"), (["training.on_nonfinite=stop"], "checkpoint.verify")])
def test_keys_without_their_partner_in_a_users_recipe_file_are_refused(capsys, workdir, extra, key):
    """Was: exit 0 on a fresh run, max_skips and verify ignored (refused on the command line)."""
    recipe = _recipe(workdir, "ms.yaml", "defaults: [debug_moe, _self_]\ntraining: {max_skips: 2}\n"
                                          "checkpoint: {verify: false}\n")
    code, err = _err(capsys, [recipe, *extra, "--cfg", "job"])
    assert code == 2 and f"{key}=" in err and "(set in recipe file" in err and "ms.yaml" in err, err
    assert f"drop {key} from" in err, err


def test_a_recipe_files_key_whose_partner_the_command_line_turns_off_is_kept(capsys, workdir):
    """A recipe may keep max_skips for the runs that skip: the command line's on_nonfinite=stop is not refused
    for it (the command line's own keys still are)."""
    recipe = _recipe(workdir, "sk.yaml", "defaults: [debug_moe, _self_]\ntraining: {max_skips: 2, on_nonfinite: skip}\n")
    code, err = _err(capsys, [recipe, "training.on_nonfinite=stop", "--cfg", "job"])
    assert code == 0, err


def test_copies_of_the_packaged_recipes_still_resolve(capsys, workdir):
    """`apiary cp NAME` of every packaged recipe resolves as the packaged one does (their own values kept)."""
    for name in recipe_names():
        assert apiary_main(["cp", name, f"cp_{name}.yaml"]) == 0
        capsys.readouterr()
        code, err = _err(capsys, [f"recipe=cp_{name}.yaml", "--cfg", "job"])
        assert code == 0, (name, err)


# ---------------------------------------------------------------- 2. --cfg job previews a run's verdict on hydra.* keys
@pytest.mark.parametrize("flags", [["--cfg", "job"], ["--info"]])
@pytest.mark.parametrize("override", ["hydra.verbose=true", "hydra.job.name=x", "hydra/launcher=basic",
                                      "hydra.searchpath=[file:///tmp]", "hydra.sweep.dir=x"])
def test_hydra_keys_a_run_refuses_are_refused_under_cfg_job_and_info(capsys, workdir, flags, override):
    """Was: exit 0 with no note under --cfg job, while the same command as a run exits 2."""
    code, err = _err(capsys, [override, *flags])
    assert code == 2 and f"override {override}" in err, err


@pytest.mark.parametrize("which", ["hydra", "all"])
def test_cfg_hydra_and_all_still_print_a_given_hydra_key(capsys, workdir, which):
    assert train_main(["--cfg", which, "-p", "hydra.verbose", "hydra.verbose=true"]) == 0
    assert "True" in capsys.readouterr().out


# ---------------------------------------------------------------- 3. autotune_configs on a CPU run
def test_autotune_configs_on_a_cpu_run_is_refused(capsys, workdir, monkeypatch):
    """Was: exit 0, `autotuned_kernels: 0`, no note: Triton does not autotune on the CPU."""
    monkeypatch.setattr(devices, "has_accelerator", lambda: False)
    code, err = _err(capsys, ["training.autotune_configs=all", "training.kernel_cache=kc", "training.steps=1",
                              "training.seq_len=64"])
    assert code == 2 and "training.autotune_configs=all" in err and "trains on the CPU" in err, err
    assert not (workdir / "runs").exists()


def test_autotune_configs_is_kept_where_the_run_is_not_on_this_cpu(capsys, workdir, monkeypatch):
    """A launch for a named GPU (preflight.gpu=H100) is not a CPU run; `--cfg job` of a run on this CPU refuses it as
    its launch would (was: accepted, pass 10's left item; tests/test_newcomer_pass11.py)."""
    monkeypatch.setattr(devices, "has_accelerator", lambda: False)
    assert train_main(["training.autotune_configs=all", "--cfg", "job"]) == 2
    assert train_main(["training.autotune_configs=all", "preflight.gpu=H100", "--cfg", "job"]) == 0
    r = resolve("debug_moe", ["training.autotune_configs=all", "preflight.gpu=H100", "output_dir=run"], for_training=True)
    assert r.cfg.training.autotune_configs == "all"
