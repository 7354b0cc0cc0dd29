"""Small slips a newcomer's pass found, each pinned: the summary's "reshuffled 1 times", the integrity
message's missing verb, `recipe=X` in an unknown key's hint, `apiary show` of a run folder, a broken pipe's
exit 1, an unreadable metrics line counted as a record."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from framework.errors import EXIT_BROKEN_PIPE, UserError

from conftest import _child_env

SUMMARY = {"step": 9, "total_steps": 9, "launches": 1, "wall_time_s": None, "tokens": 10, "data_passes": 2,
           "tokens_per_s_mean": None, "tokens_per_s_missing_because": "one logged step", "device": "cpu",
           "mfu_pct_mean": None, "peak_tflops_per_gpu": None, "mfu_missing_because": "no known peak for cpu",
           "peak_mem_bytes": None, "loss_first": None, "val_loss_last": None, "checkpoint": None}


def test_one_reshuffle_is_said_once():
    from framework.report import summary

    rows = dict(summary.lines(SUMMARY))
    assert rows["data"] == "2 passes over the training data (it ran out and was reshuffled once)"  # was: "1 times"
    assert dict(summary.lines({**SUMMARY, "data_passes": 3}))["data"].endswith("reshuffled 2 times)")


def test_an_unreadable_manifest_reads_as_a_sentence(tmp_path):
    from framework.train import integrity

    step = tmp_path / "checkpoint" / "step-40"
    step.mkdir(parents=True)
    (step / integrity.MANIFEST).write_text("{not json")
    e = integrity.corrupt_error(step, integrity.verify(step), None, "checkpoint.resume=true")
    # was: "step-40/manifest.json the manifest itself is not readable JSON"
    assert f"{step / integrity.MANIFEST} is not readable JSON of apiary's format (the manifest itself);" in str(e)


def test_an_unknown_key_names_the_recipe_in_use():
    from framework.compose import recipes

    with pytest.raises(UserError) as e:
        recipes.load("debug_dense", ["+foo.bar=1"])
    assert "Run `train recipe=debug_dense --cfg job` to list the keys." in str(e.value)  # was: recipe=X
    with pytest.raises(UserError) as e:
        recipes.load("debug_dense", ["zzqq=1"])
    assert "recipe=X" not in str(e.value)


def test_apiary_show_of_a_run_folder_says_what_it_is(tmp_path, capsys, monkeypatch):
    from toolkit.cli import apiary_main

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "mine"
    (run / "checkpoint" / "step-10").mkdir(parents=True)
    (run / "config.yaml").write_text("recipe: debug_moe\n")
    assert apiary_main(["show", "runs/mine"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "is a training run's folder" in err and "checkpoints step-10" in err, err  # was: "no recipe ... called that"
    assert "apiary export runs/mine --hf OUT" in err and "apiary logprobs runs/mine" in err
    assert apiary_main(["show", "runs/nothing_here"]) == 2
    assert "no recipe or registry name called that" in capsys.readouterr().err


def test_a_reader_that_leaves_early_ends_train_quietly(tmp_path):
    """`train --cfg job | head -2` (was: exit 1, nothing said): 141, no traceback, no message."""
    p = subprocess.Popen([sys.executable, "-m", "framework.cli", "train", "--cfg", "job"], cwd=tmp_path,
                         env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first line
    err = p.communicate(timeout=120)[1].decode()
    assert p.returncode == EXIT_BROKEN_PIPE and not err.strip(), (p.returncode, err)


def test_an_unreadable_metrics_line_moved_aside_is_named(tmp_path, capsys):
    from framework.report import metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    assert metrics.supersede(path, 4) == 3
    out = " ".join(capsys.readouterr().out.split())
    # was: "3 record(s) from step 4 on", the cut line counted as a record
    assert "2 record(s) from step 4 on, written before this resume and 1 unreadable line(s)" in out, out
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


def test_a_signal_before_the_first_step_of_a_fresh_run_names_no_checkpoint(capsys):
    """Preempted at step 0 of a fresh run (was: "the checkpoint it started from stays", none existing)."""
    from types import SimpleNamespace

    from framework.train import preempt

    guard = preempt.Guard(SimpleNamespace(step=0, checkpointer=SimpleNamespace(enable=True)), start_step=0)
    guard.stop()
    err = capsys.readouterr().err
    assert "no checkpoint was written (no step trained)" in err and "started from" not in err, err
    guard = preempt.Guard(SimpleNamespace(step=20, checkpointer=SimpleNamespace(enable=True)), start_step=20)
    guard.stop()  # a resumed run: its checkpoint stays
    assert "the checkpoint it started from stays" in capsys.readouterr().err
