"""What the sixth newcomer pass found (a read-only pass, 2026-11-29), each pinned here."""

from __future__ import annotations

import pytest


def _subcommands():
    import argparse

    from toolkit.cli import apiary_parser

    return next(a for a in apiary_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_no_apiary_help_shows_a_doubled_percent_sign():
    """#2: `apiary autotune-table --help` printed "within 2%% of the fastest" (argparse formats `help=`
    strings, not a description)."""
    for name, p in _subcommands().items():
        assert "%%" not in p.format_help(), name


def test_apiary_show_help_names_the_hf_folders_it_takes():
    """#3: `apiary show --help` left out HuggingFace folders, which it shows (the tutorial's `apiary show base_hf`)."""
    assert "HuggingFace model folder" in " ".join(_subcommands()["show"].format_help().split())


def test_every_field_of_a_cpu_runs_records_is_documented(tmp_path, capsys):
    """#27: a CPU run's metrics.jsonl held torchtitan's device-memory fields (max_active(GiB) -9e-10,
    num_ooms -1, ...) that docs/skills/progress.md, "metrics.jsonl: every field", never named. Those come
    only from a GPU now, and every field a CPU record holds is in that table."""
    import json
    import re

    from conftest import ROOT, train_here

    res = train_here(["train", "training.steps=2", f"output_dir={tmp_path / 'run'}"], tmp_path, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    keys = set().union(*(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()))
    table = (ROOT / "docs" / "skills" / "progress.md").read_text().split("## metrics.jsonl: every field", 1)[1]
    documented = {name for row in re.findall(r"^\| (.+?) \|", table, re.M) for name in re.findall(r"`([^`]+)`", row)}
    assert keys - documented == set(), sorted(keys - documented)
    assert not {"max_active(GiB)", "num_ooms"} & keys  # no device to read on a CPU


def test_a_list_key_given_one_value_in_a_recipe_file_says_it_takes_a_list(tmp_path, monkeypatch):
    """#12: `adapter: {name: lora, targets: q}` in a recipe file got OmegaConf's "AnyNode is not a ListConfig, list
    or tuple"; the command line's `adapter.targets=q` already said "takes a list"."""
    from framework.compose import recipes
    from framework.errors import UserError

    (tmp_path / "loratg.yaml").write_text("defaults:\n  - debug_moe\n  - _self_\nadapter:\n  name: lora\n  targets: q\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        recipes.load("loratg.yaml", [])
    msg = " ".join(str(e.value).split())
    assert "adapter.targets: takes a list, not 'q' (for example targets: [q])" in msg and "AnyNode" not in msg, msg


@pytest.mark.parametrize("step, unverified, flag", [(3, False, "--step"), (None, True, "--unverified")])
def test_logprobs_of_an_hf_folder_refuses_the_flags_of_a_run_folder(tmp_path, step, unverified, flag):
    """#18: `apiary logprobs HF_FOLDER ... --unverified` was taken silently (it applies to a run folder's
    checkpoint), while `--step` on the same folder was refused: both are now."""
    from framework.errors import UserError
    from toolkit.logprobs import load_model

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        load_model(str(tmp_path), step, "cpu", unverified=unverified)
    assert f"is a HuggingFace folder; {flag} applies to a checkpoint of a run folder" in str(e.value)
    assert f"Drop {flag}." in str(e.value)


def test_apiary_show_of_a_skill_pages_topic_names_the_page(capsys):
    """#37: `apiary show tis` suggested 'cispo', though docs/skills/tis.md is the page a reader wanted."""
    from toolkit.cli import apiary_main

    assert apiary_main(["show", "tis"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "it is a skill page: docs/skills/tis.md" in err and "cispo" not in err, err


def test_a_sweep_job_refused_before_any_runs_is_named_by_its_swept_values(tmp_path, monkeypatch, capsys):
    """#28: `train -m loss=ce,chunked loss.num_chunks=2` answered "write loss=chunked loss.num_chunks=2" without
    saying that the ce job was the one refused."""
    from framework.cli import train_main

    monkeypatch.chdir(tmp_path)
    assert train_main(["-m", "loss=ce,chunked", "loss.num_chunks=2", "training.steps=1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "train -m job 0 (loss=ce): override loss.num_chunks=2: unknown key 'loss.num_chunks'" in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "multirun").exists()  # no job started
