"""Newcomer pass 5 (issue 46's last condition; docs/newcomer_fifth_pass.md): what a new user on a CPU
machine met on paths the earlier passes did not take, each pinned. A torchrun of one's own whose run
printed a one-process resume (refused for its data-parallel size), `apiary cp` to a name `train` cannot
read, a fresh run of another recipe in a used folder, several recipes in one `recipe=`, a recipe's
`loss: chunked` and `defaults: [debug_mo]`, `apiary show NAME registry=FILE`, and `apiary export` of a
run whose only step lost its .metadata."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from framework.compose import recipes, registry
from framework.errors import UserError
from framework.report import summary
from framework.resolve import resume


def _train(argv, capsys) -> tuple[int, str]:
    from framework.cli import train_main

    code = train_main(argv)
    return code, " ".join(capsys.readouterr().err.split())


def _apiary(argv, capsys) -> tuple[int, str]:
    from toolkit.cli import apiary_main

    code = apiary_main(argv)
    return code, " ".join(capsys.readouterr().err.split())


def _ranked_run(tmp_path, given: list[str], dp_shard: int):
    """A finished run folder of debug_moe as its ranks write it: the resolved dims in config.yaml, the
    launch's overrides as given (a torchrun of one's own gives no nproc), a complete step 3."""
    d = tmp_path / "run"
    d.mkdir()
    cfg = recipes.load("debug_moe", ["training.steps=3", *given])
    cfg.parallel.dp_shard, cfg.parallel.ep = dp_shard, dp_shard
    for k in ("dp_replicate", "cp", "tp", "pp"):
        cfg.parallel[k] = 1
    OmegaConf.save(cfg, d / "config.yaml")
    resume.write_launch(d, {"recipe": "debug_moe", "overrides": ["training.steps=3", *given]})
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0, "elapsed_s": s}) + "\n"
                                             for s in (1, 2, 3)))
    (d / "checkpoint" / "step-3").mkdir(parents=True)
    (d / "checkpoint" / "step-3" / "manifest.json").write_text("{}")
    return d


def test_a_run_of_a_torchrun_of_ones_own_resumes_with_its_ranks(tmp_path, monkeypatch):
    """docs/launching.md "torchrun by hand" with 2 ranks: the printed resume started one process (was:
    refused, parallel.dp_shard 2 then, 1 now); it names nproc=2, or torchrun's shape across machines."""
    for k in ("LOCAL_WORLD_SIZE", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    d = _ranked_run(tmp_path, [], dp_shard=2)
    cmd = summary.summarize(d)["next"]["resume"]
    assert cmd.startswith("train recipe=debug_moe") and cmd.endswith(" nproc=2"), cmd
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two machines of one rank each
    cmd = summary.summarize(d)["next"]["resume"]
    assert cmd.startswith("torchrun --nnodes=2 --nproc_per_node=1 ") and "-m framework.cli train recipe=" in cmd, cmd
    assert "nproc=" not in cmd.split("train recipe=")[1]


@pytest.mark.parametrize("given,ranks", [(["launcher.nproc=2"], 2), ([], 1)], ids=["train nproc=2", "one process"])
def test_a_run_that_named_its_ranks_resumes_as_it_was_launched(tmp_path, monkeypatch, given, ranks):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cmd = summary.summarize(_ranked_run(tmp_path, given, dp_shard=ranks))["next"]["resume"]
    assert cmd.startswith("train ") and cmd.count("nproc=") == len(given), cmd


def test_apiary_cp_refuses_a_name_train_cannot_read(tmp_path, monkeypatch, capsys):
    """Was: copied to mine.txt with "run it with `train recipe=mine.txt`", which train refused."""
    monkeypatch.chdir(tmp_path)
    code, err = _apiary(["cp", "debug_moe", "mine.txt"], capsys)
    assert code == 2 and "finds only files named *.yaml" in err and "Name it mine.yaml." in err, err
    assert not (tmp_path / "mine.txt").exists()
    (tmp_path / "sub").mkdir()
    assert _apiary(["cp", "debug_moe", "sub"], capsys)[0] == 0 and (tmp_path / "sub" / "debug_moe.yaml").is_file()


def test_a_fresh_run_of_another_recipe_in_a_used_folder_is_refused(tmp_path, monkeypatch, capsys):
    """A folder holding a debug_moe run without checkpoints (checkpoint.enable=false): a debug_dense run there
    replaced its config.yaml and said its records were "written before this resume"."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("recipe: debug_moe\ntraining:\n  steps: 2\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    code, err = _train(["recipe=debug_dense", f"output_dir={run}", "training.steps=1"], capsys)
    assert code == 2 and "holds a run of another recipe (debug_moe" in err and "Choose another output_dir" in err, err
    assert "debug_moe" in (run / "config.yaml").read_text()


def test_a_fresh_run_names_the_records_it_moves_as_an_earlier_runs(tmp_path, capsys):
    from framework.report import metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    assert metrics.supersede(path, 1) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "2 record(s) from step 1 on, written by an earlier run in this folder" in out, out


def test_several_recipes_in_one_recipe_are_named_as_such(capsys):
    from toolkit.compare.args import parse_args

    # was: "unknown recipe 'debug_moe,debug_dense'" (train -m), "no key to compare" (apiary compare)
    code, err = _train(["-m", "recipe=debug_moe,debug_dense", "training.steps=2"], capsys)
    assert code == 2 and "names several recipes; recipe= takes one" in err, err
    assert "recipe=debug_moe, then recipe=debug_dense" in err
    with pytest.raises(UserError) as e:
        parse_args(["recipe=debug_moe,debug_dense", "training.steps=2"])
    assert "names several recipes" in str(e.value), str(e.value)


def test_a_recipe_naming_a_component_without_its_section_says_how(tmp_path, capsys):
    """`loss: chunked` in a recipe (was: "Merge error: str is not a subclass of CrossEntropy_Options_schema")."""
    f = tmp_path / "mine.yaml"
    f.write_text("defaults:\n  - debug_moe\n  - _self_\nloss: chunked\n")
    code, err = _train([f"recipe={f}", "--cfg", "job"], capsys)
    assert code == 2 and "sets `loss: chunked`" in err and "Write `loss: {name: chunked}`" in err, err
    assert "override /loss: chunked" in err and "Merge error" not in err


def test_a_recipe_extending_a_recipe_that_is_not_there_suggests_the_name(tmp_path, capsys):
    """Was: Hydra's "Could not load 'debug_mo'. Config search path: provider=hydra, path=pkg://hydra.conf"."""
    f = tmp_path / "mine.yaml"
    f.write_text("defaults:\n  - debug_mo\n  - _self_\n")
    code, err = _train([f"recipe={f}", "--cfg", "job"], capsys)
    assert code == 2 and "extends 'debug_mo', which is neither a recipe file beside it" in err, err
    assert "Did you mean 'debug_moe'" in err and "pkg://hydra.conf" not in err


def test_apiary_show_takes_a_user_registry_file(tmp_path, monkeypatch, capsys):
    """`apiary ls registry=FILE` lists a user's names; `apiary show NAME registry=FILE` was "unrecognized
    arguments"."""
    from toolkit.cli import apiary_main

    (tmp_path / "reg.yaml").write_text('loss:\n  my_ce:\n    target: "my_ce:MyCE"\n    doc: "my cross-entropy"\n')
    monkeypatch.setattr(registry, "_USED", [])
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.entries.cache_clear()
    try:
        code = apiary_main(["show", "my_ce", f"registry={tmp_path / 'reg.yaml'}"])
        out = capsys.readouterr().out
    finally:
        registry.entries.cache_clear()  # the next caller reads registry.yaml afresh
    assert code == 0 and "loss my_ce: my cross-entropy" in out, out
    code, err = _apiary(["show", "my_ce", "foo=bar"], capsys)
    assert code == 2 and "takes only registry=PATH" in err, err


def test_export_of_a_run_whose_only_step_lost_its_metadata_names_it(tmp_path, capsys):
    """Was: "holds no complete checkpoint ... Train with checkpoint.enable=true first", for a run that had."""
    run = tmp_path / "run"
    (run / "checkpoint" / "step-10").mkdir(parents=True)
    (run / "checkpoint" / "step-10" / "__0_0.distcp").write_bytes(b"x")
    (run / "config.yaml").write_text("recipe: debug_moe\n")
    code, err = _apiary(["export", str(run), "--hf", str(tmp_path / "hf")], capsys)
    assert code == 2 and "checkpoint/step-10 has no .metadata" in err and "checkpoint.enable" not in err, err


def test_a_load_path_given_a_run_folder_names_its_latest_step(tmp_path, monkeypatch, capsys):
    """Was: "Point it at a step folder, e.g. runs/X/checkpoint/step-0" for a run folder with step-10."""
    monkeypatch.chdir(tmp_path)
    step = tmp_path / "run" / "checkpoint" / "step-10"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    code, err = _train([f"checkpoint.load_path={tmp_path / 'run'}", "training.steps=1"], capsys)
    assert code == 2 and f"but a run's folder. Point it at a step folder, e.g. {step}." in err, err


def test_a_recipe_without_self_composes_its_own_values_last_without_hydras_warning(tmp_path, monkeypatch):
    """Pass 5's #13: `defaults: [debug_moe]` without `_self_` printed Hydra's UserWarning with its site-packages
    file and line; Hydra composes the file's own values last, as apiary's recipes write `_self_`, so the
    warning said nothing to act on."""
    import warnings

    from framework.compose import recipes

    (tmp_path / "noself.yaml").write_text("defaults:\n  - debug_moe\ntraining:\n  steps: 7\n")
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = recipes.load("noself.yaml", [])
    assert cfg.training.steps == 7  # the file's value over debug_moe's
    assert not [w for w in seen if "_self_" in str(w.message)], [str(w.message) for w in seen]
