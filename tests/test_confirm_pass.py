"""What a newcomer's confirmation pass found after the fixes of its first pass: each refused with the
right paragraph before any worker starts (in process: the console entry's own function)."""

from __future__ import annotations

from pathlib import Path

from framework.train import integrity


def _train(argv, capsys) -> tuple[int, str]:
    from framework.cli import train_main

    code = train_main(argv)
    return code, capsys.readouterr().err


def test_a_checkpoint_load_path_that_does_not_exist_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = _train([f"checkpoint.load_path={tmp_path / 'nope'}", "training.steps=1"], capsys)
    assert code == 2 and "does not exist (nothing at that path)" in err, err
    assert "no .metadata" not in err


def test_a_cp_that_does_not_divide_the_ranks_is_said_before_the_seq_len_rule(tmp_path, monkeypatch, capsys):
    """parallel.cp=3 on 2 ranks: the ranks are the problem (a seq_len fix would only lead to it)."""
    monkeypatch.chdir(tmp_path)
    code, err = _train(["parallel.cp=3", "nproc=2", "--cfg", "job"], capsys)
    assert code == 2 and "CP 3 does not divide the 2 ranks" in err, err


def test_a_step_folder_renamed_in_place_stops_a_fresh_run_before_torchtitan_loads_it(tmp_path, monkeypatch, capsys):
    """torchtitan loads any name holding step-N in the checkpoint folder (step-3.bad is step 3 to it): a
    fresh run there is refused with one paragraph instead of a worker's FileNotFoundError."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoint" / "step-3.bad").mkdir(parents=True)
    (run / "checkpoint" / "step-3.bad" / ".metadata").write_bytes(b"x")
    code, err = _train([f"output_dir={run}", "training.steps=1"], capsys)
    assert code == 2 and "step-3.bad is named like a checkpoint step" in err, err
    assert "Move it out of the checkpoint folder" in err
    assert integrity.step_like(run / "checkpoint") == [run / "checkpoint" / "step-3.bad"]
    assert integrity.step_like(tmp_path / "absent") == []


def test_the_corrupt_step_advice_says_where_to_move_it():
    err = integrity.corrupt_error(Path("/r/checkpoint/step-3"), ("__0_0.distcp", "bytes changed"), None, "w")
    assert "move /r/checkpoint/step-3 out of its checkpoint folder and start a fresh run" in str(err), str(err)
