"""Rollout records are checked where they are read (components/data/rollouts.py, follow.py, formats.py;
docs/rl.md "What a record may contain"): a value the loader or the losses cannot train on is refused
naming file:line and the field, before launch for files (exit 2, one paragraph) and, in follow mode, at
the step that would read it (the last complete step saved, exit 2, the position kept). Duplicates are
trained once; shards changed under a following trainer are named. Most cases run the readers in
process; two runs check the trainer's stop (a value error, and routing replay)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from components.data.follow import FollowRows
from components.data.rollouts import RolloutIndex

from conftest import ROOT, run_cli, train_here

PACKAGED = ROOT / "components" / "data" / "tiny_rollouts.jsonl"  # 82-token records: 3 per 256-token row
RECORDS = [json.loads(line) for line in PACKAGED.read_text().splitlines() if line.strip()]
VOCAB = 320  # debug_grpo's vocabulary (byte tokenizer)


def rec(i: int, **change) -> dict:
    """Packaged record i with sequence_id r<i> and the changes."""
    return {**RECORDS[i % len(RECORDS)], "sequence_id": f"r{i}", **change}


def write(path: Path, recs: list[dict]) -> Path:
    """A jsonl file (a followed shard: written aside, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tmp.rename(path)
    return path


def shard(folder: Path, index: int, first: int | None = None, n: int = 6, **change) -> Path:
    first = index * n if first is None else first
    return write(folder / f"{index:06d}.jsonl", [rec(first + j, **change) for j in range(n)])


def rows(folder: Path, **kw) -> FollowRows:
    opts = dict(seq_len=256, dp_rank=0, dp_world_size=1, local_batch=2, global_batch=2, vocab_size=VOCAB)
    opts.update(kw)
    return FollowRows(str(folder), **opts)


def step(ds: FollowRows, it, k: int) -> dict:
    """Consume one step of ``global_batch`` rows; the step's ledger report."""
    assert ds.ready(), "the step's rows are not there"  # (the iterator would wait for them)
    for _ in range(ds.step_rows):
        next(it)
    return ds.step_report(k)


# ------------------------------------------------------------------ values: one rule, both readers

NAN, INF = float("nan"), float("inf")
BAD_VALUES = [  # (name, change to record 1, the field named in the error, words of the rule)
    ("negative id", {"input_ids": [5, -3] + RECORDS[1]["input_ids"][2:]}, "input_ids[1] is -3", "token ids are >= 0"),
    ("id above the vocabulary", {"input_ids": [5, 900] + RECORDS[1]["input_ids"][2:]}, "input_ids[1] is 900",
     "outside the model's vocabulary (320)"),
    ("float id", {"input_ids": [5, 3.7] + RECORDS[1]["input_ids"][2:]}, "input_ids[1] is 3.7", "token ids are integers"),
    ("mask -1", {"loss_mask": [0, -1] + RECORDS[1]["loss_mask"][2:]}, "loss_mask[1] is -1", "0 (not trained) or 1"),
    ("old_logprob > 0", {"old_logprobs": RECORDS[1]["old_logprobs"][:-1] + [0.7]}, "old_logprobs[81] is 0.7",
     "a log-prob is <= 0"),
    ("NaN old_logprob", {"old_logprobs": RECORDS[1]["old_logprobs"][:-1] + [NAN]}, "old_logprobs[81] is nan",
     "finite"),
    ("-inf old_logprob", {"old_logprobs": RECORDS[1]["old_logprobs"][:-1] + [-INF]}, "old_logprobs[81] is -inf",
     "finite"),
    ("NaN advantage", {"advantages": NAN}, "advantages is nan", "finite"),
    ("inf advantage", {"advantages": INF}, "advantages is inf", "finite"),
    ("-1e38 advantage", {"advantages": -1e38}, "advantages is -1e+38", "|a| <= 1e+06"),
    ("-1e38 per-token advantage", {"advantages": [0.5] * 81 + [-1e38]}, "advantages[81] is -1e+38", "|a| <= 1e+06"),
    ("negative policy_version", {"policy_version": -2}, "policy_version", "an integer >= 0"),
]


@pytest.mark.parametrize("name,change,field,rule", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_a_bad_value_is_refused_naming_file_line_and_field(tmp_path, name, change, field, rule):
    path = write(tmp_path / "r.jsonl", [rec(0), rec(1, **change), rec(2)])
    with pytest.raises(ValueError) as err:  # the check before launch (formats.Rollouts.check)
        RolloutIndex(path, validate=True, vocab_size=VOCAB)
    assert f"{path}:2: {field}" in str(err.value) and rule in str(err.value), str(err.value)
    folder = tmp_path / "follow"
    folder.mkdir()
    shard(folder, 0)
    write(folder / "000001.jsonl", [rec(6), rec(7, **change), rec(8)])
    ds = rows(folder)
    it = iter(ds)
    step(ds, it, 1)
    with pytest.raises(ValueError) as err:  # follow mode: at the step that reads it (trainer: exit 2)
        ds.ready()
    assert f"{folder / '000001.jsonl'}:2: {field}" in str(err.value) and rule in str(err.value), str(err.value)


def test_values_in_range_still_train(tmp_path):
    """The edges are allowed: log-probs a hair above 0 (rounding), any finite value where loss_mask is 0,
    integral policy versions, id vocab-1, masks as booleans."""
    lp = [5.0, 0.0] + [-0.5] * 79 + [1e-7]  # position 0 is never trained
    ok = rec(1, old_logprobs=lp, loss_mask=[True] + [False] + [True] * 80, policy_version=0,
             input_ids=[VOCAB - 1] + RECORDS[1]["input_ids"][1:], advantages=-1e6)
    index = RolloutIndex(write(tmp_path / "r.jsonl", [rec(0), ok]), validate=True, vocab_size=VOCAB)
    assert index.lengths == [82, 82]


def test_a_bad_value_stops_the_launch_in_one_paragraph(workdir):
    """Static files, through the real command: exit 2, file:line and the field, no traceback, nothing written
    (was: a negative id trained into a [rank0] IndexError traceback with no checkpoint)."""
    path = write(workdir / "r.jsonl", [rec(i) for i in range(5)] + [rec(5, input_ids=[1, -1] + [2] * 80)])
    res = run_cli(["train", "recipe=debug_grpo", f"data.path={path}", "output_dir=run"], workdir, timeout=240)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"{path}:6: input_ids[1] is -1" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert not (workdir / "run").exists()


# ------------------------------------------------------------------ a record that trains no token


def test_records_that_train_no_token_are_skipped_and_said(tmp_path, capsys):
    """A record whose loss_mask has no 1 after position 0 trains nothing: both readers skip it and say so,
    so no step is made of such records only (was: a step of them logged as trained, loss 0, grad_norm 0)."""
    none = {"loss_mask": [1] + [0] * 81}  # position 0 is never predicted
    path = write(tmp_path / "r.jsonl", [rec(0), rec(1, **none), rec(2)])
    index = RolloutIndex(path, validate=True)
    assert len(index.lengths) == 2 and index.untrained == [f"{path}:2"]
    assert len(RolloutIndex(path).lengths) == 2  # the workers' index skips it too
    write(tmp_path / "none.jsonl", [rec(i, **none) for i in range(3)])
    with pytest.raises(ValueError, match=r"no rollout records with a token to train \(3 record\(s\)"):
        RolloutIndex(tmp_path / "none.jsonl", validate=True)
    folder = tmp_path / "follow"
    folder.mkdir()
    shard(folder, 0, **none)  # a whole shard (a step's worth) of records that train nothing
    shard(folder, 1)
    ds = rows(folder)
    it = iter(ds)
    report = step(ds, it, 1)
    assert report["records"] == [f"r{i}" for i in range(6, 12)] and report["untrained"] == [f"r{i}" for i in range(6)]
    assert "000000.jsonl: 6 record(s) with no loss_mask=1 token after position 0 skipped" in capsys.readouterr().out


def test_records_that_train_no_token_are_said_in_the_runs_first_lines(workdir):
    from framework.resolve.resolver import resolve

    path = write(workdir / "r.jsonl", [rec(i) for i in range(6)] + [rec(6, loss_mask=[0] * 82)])
    r = resolve("debug_grpo", [f"data.path={path}"], world_size=1)
    assert any("1 record(s) with no loss_mask=1 token after position 0 skipped" in line and f"{path}:7" in line
               for line in r.data_summary.splitlines()), r.data_summary


# ------------------------------------------------------------------ policy_version ahead of the trainer


def test_a_version_ahead_of_the_trainer_is_refused(tmp_path):
    shard(tmp_path, 0, policy_version=0)
    shard(tmp_path, 1, policy_version=3)  # step 2 trains on version 1 (publish off: the steps done)
    ds = rows(tmp_path, max_lag=4)
    it = iter(ds)
    step(ds, it, 1)
    with pytest.raises(ValueError, match=r"000001\.jsonl:1: policy_version 3 is ahead of the trainer's version 1"):
        ds.ready()


def test_after_a_resume_records_of_discarded_versions_train_and_are_named(tmp_path, capsys):
    """A resume from a checkpoint older than the last publication: shards written before it may carry
    versions the resume discarded. They train (their lag not counted); a shard written after the
    resume with a version ahead is refused."""
    shard(tmp_path, 0, policy_version=0)
    ds = rows(tmp_path)
    it = iter(ds)
    step(ds, it, 1)
    state = ds.state_dict()
    shard(tmp_path, 1, policy_version=4)  # the killed run had reached version 4
    again = rows(tmp_path)
    again.load_state_dict(state)
    it2 = iter(again)
    report = step(again, it2, 2)
    assert report["records"] == [f"r{i}" for i in range(6, 12)] and report["lag_max"] is None
    assert "000001.jsonl: 6 record(s) with a policy_version ahead of the trainer's version 1" in capsys.readouterr().out
    shard(tmp_path, 2, policy_version=9)
    with pytest.raises(ValueError, match=r"000002\.jsonl:1: policy_version 9 is ahead"):
        again.ready()


# ------------------------------------------------------------------ duplicates


def test_static_duplicates_train_once_and_a_reused_id_is_refused(tmp_path):
    """Files: the same record twice (within a file, across files, a file copied under another name)
    is trained once and said; another record under a sequence_id already used is refused, naming both."""
    (tmp_path / "d").mkdir()
    a = write(tmp_path / "d" / "a.jsonl", [rec(0), rec(1), rec(0), rec(2)])
    (tmp_path / "d" / "b.jsonl").write_bytes(a.read_bytes())  # a copy under another name
    write(tmp_path / "d" / "c.jsonl", [rec(1), rec(3)])
    index = RolloutIndex(tmp_path / "d", validate=True)
    assert len(index.lengths) == 4  # r0, r1, r2, r3
    said = " ".join(index.skipped)
    assert f"{a}:3: sequence_id 'r0' again, the same record as {a}:1" in said
    assert f"{tmp_path / 'd' / 'b.jsonl'}: the same bytes as {a}" in said and f"{tmp_path / 'd' / 'c.jsonl'}:1" in said
    assert len(RolloutIndex(tmp_path / "d").lengths) == 4  # the workers' index skips the same records
    write(tmp_path / "d" / "c.jsonl", [rec(1, advantages=-0.25)])
    with pytest.raises(ValueError, match=rf"c\.jsonl:1: sequence_id 'r1' is also the sequence_id of {a}:2"):
        RolloutIndex(tmp_path / "d", validate=True)


def test_static_duplicates_are_said_in_the_runs_first_lines(workdir):
    from framework.resolve.resolver import resolve

    path = write(workdir / "r.jsonl", [rec(i) for i in range(6)] + [rec(2)])
    r = resolve("debug_grpo", [f"data.path={path}"], world_size=1)
    assert any("1 duplicate(s) skipped, each trained once" in line and f"{path}:7" in line
               for line in r.data_summary.splitlines()), r.data_summary


def test_followed_duplicates_train_once(tmp_path, capsys):
    """A record twice in a shard, a shard copied under a new name, a copy after a resume: each record
    trains once, and each skip names both places."""
    write(tmp_path / "000000.jsonl", [rec(0), rec(1), rec(0), rec(2), rec(3), rec(4), rec(5)])
    ds = rows(tmp_path)
    it = iter(ds)
    assert step(ds, it, 1)["records"] == [f"r{i}" for i in range(6)]
    assert f"{tmp_path / '000000.jsonl'}:3: sequence_id 'r0' again, the same record as" in capsys.readouterr().out
    (tmp_path / "000001.jsonl").write_bytes((tmp_path / "000000.jsonl").read_bytes())  # copied under a new name
    shard(tmp_path, 2)
    report = step(ds, it, 2)
    assert report["records"] == [f"r{i}" for i in range(12, 18)] and report["duplicates"] == ["000001.jsonl"]
    assert "000001.jsonl has the bytes of" in capsys.readouterr().out
    again = rows(tmp_path)  # resumed: the shards before its position are remembered
    again.load_state_dict(ds.state_dict())
    write(tmp_path / "000003.jsonl", [rec(3)] + [rec(i) for i in range(18, 23)])  # r3 again, then new ones
    it2 = iter(again)
    assert step(again, it2, 3)["records"] == [f"r{i}" for i in range(18, 23)]
    assert "000003.jsonl:1: sequence_id 'r3' again, the same record as" in capsys.readouterr().out


def test_a_followed_shard_reusing_an_id_for_another_record_is_refused(tmp_path):
    shard(tmp_path, 0)
    ds = rows(tmp_path)
    it = iter(ds)
    step(ds, it, 1)
    write(tmp_path / "000001.jsonl", [rec(i + 100, sequence_id=f"r{i}") for i in range(6)])  # ids from 0 again
    with pytest.raises(ValueError, match=r"000001\.jsonl:1: sequence_id 'r0' is also the sequence_id of .*000000\.jsonl:1"):
        ds.ready()


# ------------------------------------------------------------------ shards changed under the trainer


def test_a_shard_deleted_after_part_of_it_trained_is_named_and_listed(tmp_path, capsys):
    shard(tmp_path, 0, n=8)  # rows of 3 + 3 (step 1), 2 records left
    ds = rows(tmp_path)
    it = iter(ds)
    step(ds, it, 1)
    state = ds.state_dict()
    (tmp_path / "000000.jsonl").unlink()
    shard(tmp_path, 1, first=20)
    report = step(ds, it, 2)
    assert report["missing_shards"] == ["000000.jsonl"] and report["records"] == [f"r{i}" for i in range(20, 26)]
    out = capsys.readouterr().out
    assert "000000.jsonl was deleted after 6 of its 8 records were trained: the other 2 are not trained" in out
    again = rows(tmp_path)  # the same after a resume (nothing of the shard in memory)
    again.load_state_dict(state)
    it2 = iter(again)
    assert step(again, it2, 2)["missing_shards"] == ["000000.jsonl"]
    assert "000000.jsonl was deleted after 6 of its records were trained" in capsys.readouterr().out


def test_a_shard_read_then_deleted_before_it_trained_is_named(tmp_path, capsys):
    shard(tmp_path, 0, n=3)  # one row of the step's two: the step waits, shard 0 read
    ds = rows(tmp_path)
    assert not ds.ready()
    (tmp_path / "000000.jsonl").unlink()
    shard(tmp_path, 1, first=3)
    it = iter(ds)
    report = step(ds, it, 1)
    assert report["missing_shards"] == ["000000.jsonl"] and report["records"] == [f"r{i}" for i in range(3, 9)]
    assert "000000.jsonl was deleted after it was read, before it was trained" in capsys.readouterr().out


def test_a_shard_renamed_over_a_trained_one_is_named(tmp_path, capsys):
    shard(tmp_path, 0)
    ds = rows(tmp_path)
    it = iter(ds)
    step(ds, it, 1)
    shard(tmp_path, 0, first=50)  # new records under a trained shard's name
    shard(tmp_path, 1)
    assert step(ds, it, 2)["records"] == [f"r{i}" for i in range(6, 12)]
    assert "000000.jsonl changed after its records were trained" in capsys.readouterr().out


def test_a_shard_changed_before_it_trained_is_read_again(tmp_path, capsys):
    shard(tmp_path, 0, n=3)
    ds = rows(tmp_path)
    assert not ds.ready()  # shard 0 read; the step needs another row
    shard(tmp_path, 0, first=40, n=6)  # rewritten whole before it trained
    it = iter(ds)
    assert step(ds, it, 1)["records"] == [f"r{i}" for i in range(40, 46)]
    assert "000000.jsonl changed after the trainer read it, before it was trained: it is read again" in \
        capsys.readouterr().out


def test_entries_that_are_not_shards_are_named_once(tmp_path, capsys):
    shard(tmp_path, 0)
    write(tmp_path / "000001.json", [rec(6)])  # wrong suffix
    (tmp_path / "000002.jsonl").mkdir()  # a folder under a shard's name
    os.symlink("/dev/zero", tmp_path / "000003.jsonl")
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "000004.jsonl")
    (tmp_path / "000005.jsonl.tmp").write_text("being written\n")  # the writer's convention: not named
    ds = rows(tmp_path)
    assert ds.ready() and ds.ready()
    ds._plan = None
    assert ds.ready()  # planned again: nothing said twice
    out = capsys.readouterr().out
    for name, why in [("000001.json", "a shard's name ends in .jsonl or .parquet"), ("000002.jsonl", "a folder"),
                      ("000003.jsonl", "not a regular file"), ("000004.jsonl", "which does not exist")]:
        assert out.count(f"{tmp_path / name} in the rollout folder is not read: ") == 1, out
        assert why in out
    assert "000005" not in out


def test_static_entries_that_are_not_files_are_refused(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    write(d / "a.jsonl", [rec(0)])
    for make, why in [(lambda p: p.mkdir(), "a folder"), (lambda p: os.symlink("/dev/zero", p), "not a regular file"),
                      (lambda p: os.symlink(d / "gone", p), "which does not exist")]:
        bad = d / "b.jsonl"
        make(bad)
        with pytest.raises(ValueError, match=why):
            RolloutIndex(d, validate=True)
        bad.rmdir() if bad.is_dir() and not bad.is_symlink() else bad.unlink()


# ------------------------------------------------------------------ routing replay in follow mode


def _routed(i: int, layers: int = 2, k: int = 2, experts: int = 8) -> dict:
    n = len(RECORDS[i % len(RECORDS)]["input_ids"])
    return rec(i, routed_experts=[[[(t + j + m) % experts for m in range(k)] for j in range(layers)] for t in range(n)])


@pytest.mark.parametrize("change,words", [
    ("range", "routed_experts[0][1][1] is expert id 8, outside [0, 8)"),
    ("missing", "no routed_experts; moe.routing_replay=true needs routed_experts in every rollout record"),
    ("k", "wrong number of experts per token (top-k)"),
])
def test_routing_replay_records_are_checked_as_shards_arrive(tmp_path, change, words):
    write(tmp_path / "000000.jsonl", [_routed(i) for i in range(6)])
    bad = [_routed(i) for i in range(6, 12)]
    if change == "range":
        bad[1]["routed_experts"][0][1][1] = 8
    elif change == "missing":
        bad[1].pop("routed_experts")
    else:
        bad[1] = _routed(7, k=3)
    write(tmp_path / "000001.jsonl", bad)
    ds = rows(tmp_path, routing=(2, 2, 8))
    it = iter(ds)
    x, _ = next(it)
    assert tuple(x["rl_routed_experts"].shape[1:]) == (2, 2)
    next(it)
    with pytest.raises(ValueError) as err:
        ds.ready()
    assert f"{tmp_path / '000001.jsonl'}:2: " in str(err.value) and words in str(err.value), str(err.value)


# ------------------------------------------------------------------ the trainer stops as for a malformed shard

ARGS = ["recipe=debug_grpo", "data.follow=true", "training.local_batch=2", "checkpoint.interval=10",
        "logging.tensorboard=false", "training.steps=2"]


@pytest.mark.parametrize("case", ["negative id", "routing replay"])
def test_a_bad_followed_record_saves_the_last_step_and_exits_2(tmp_path, capsys, case):
    """Was: a negative id an IndexError traceback, an expert id out of range a RuntimeError, both exit 1
    without a checkpoint. Now as a malformed shard: step 1 saved, exit 2 naming file:line and field."""
    data, run = tmp_path / "shards", tmp_path / "run"
    data.mkdir()
    argv = [*ARGS, f"data.path={data}", f"output_dir={run}"]
    if case == "negative id":
        shard(data, 0)
        shard(data, 1)
        bad = json.loads((data / "000001.jsonl").read_text().splitlines()[1])
        bad["input_ids"][5] = -4
        field = "input_ids[5] is -4"
    else:
        argv.append("moe.routing_replay=true")
        write(data / "000000.jsonl", [_routed(i) for i in range(6)])
        write(data / "000001.jsonl", [_routed(i) for i in range(6, 12)])
        bad = json.loads((data / "000001.jsonl").read_text().splitlines()[1])
        bad["routed_experts"][3][0][1] = 99
        field = "routed_experts[3][0][1] is expert id 99, outside [0, 8)"
    lines = (data / "000001.jsonl").read_text().splitlines()
    write(data / "000001.jsonl", [json.loads(lines[0]), bad, *map(json.loads, lines[2:])])
    res = train_here(["train", *argv], tmp_path, capsys)
    err = res.stderr
    assert res.returncode == 2, res.stdout[-2000:] + err[-3000:]
    assert f"{data / '000001.jsonl'}:2: {field}" in err and "checkpoint step-1 saved" in err, err[-3000:]
    assert "Traceback" not in err and "RuntimeError" not in err and "IndexError" not in err, err[-3000:]
    assert (run / "checkpoint" / "step-1").is_dir()
