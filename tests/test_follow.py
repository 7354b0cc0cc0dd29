"""Follow mode (data.follow=true): rollout shards trained as a generator writes them, each record
exactly once across kill -9 and resume; waiting, signals, timeouts and malformed shards
(components/data/follow.py, framework/train/trainer.py's wait, docs/rl.md)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from components.data.follow import FollowRows

from conftest import ROOT, _child_env, run_cli, train_here

PACKAGED = ROOT / "components" / "data" / "tiny_rollouts.jsonl"  # 82-token records: 3 per 256-token row
RECORDS = [json.loads(line) for line in PACKAGED.read_text().splitlines() if line.strip()]
ARGS = ["recipe=debug_grpo", "data.follow=true", "training.local_batch=2", "checkpoint.interval=2",
        "logging.tensorboard=false"]


def _set(base: list[str], *extra: str) -> list[str]:
    """``base`` with ``extra`` in place of the keys it sets again (`train` refuses a key given twice)."""
    keys = {e.partition("=")[0] for e in extra}
    return [a for a in base if a.partition("=")[0] not in keys] + list(extra)


def write_shard(folder: Path, index: int, per_shard: int = 6, version: int | None = None, first: int | None = None,
                bad_line: int | None = None) -> list[str]:
    """Shard ``index`` (records first..first+per_shard of the packaged set, ids r<N>), written aside
    and renamed as the writer's convention says; returns the ids."""
    first = index * per_shard if first is None else first
    ids, lines = [], []
    for j in range(per_shard):
        rec = dict(RECORDS[(first + j) % len(RECORDS)], sequence_id=f"r{first + j}")
        if version is not None:
            rec["policy_version"] = version
        ids.append(rec["sequence_id"])
        lines.append(json.dumps(rec) if bad_line != j + 1 else '{"input_ids": [1, 2, ')
    tmp = folder / f"{index:06d}.jsonl.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.rename(folder / f"{index:06d}.jsonl")
    return ids


def ledger(run: Path) -> list[dict]:
    f = run / "rollouts.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "framework.cli", "train", *argv], cwd=cwd,
                            env=_child_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_until(cond, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (code {proc.returncode}) early:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"timed out:\n{proc.stdout.read()[-4000:]}")


# ------------------------------------------------------------------ the planner of rows, in process


def _rows(tmp_path, **kw) -> FollowRows:
    opts = dict(seq_len=256, dp_rank=0, dp_world_size=1, local_batch=2, global_batch=2)
    opts.update(kw)
    return FollowRows(str(tmp_path), **opts)


def test_rows_wait_for_a_full_step_and_never_span_shards(tmp_path):
    ds = _rows(tmp_path)
    assert not ds.ready()  # an empty folder
    write_shard(tmp_path, 0, per_shard=4)  # 4 records of 82 tokens: rows of 3 + 1 (a row ends with its shard)
    (tmp_path / "000001.jsonl.tmp").write_text("not yet a shard\n")  # being written: never read
    (tmp_path / ".000002.jsonl").write_text("neither\n")
    assert ds.ready()
    it = iter(ds)
    _, a = next(it)
    _, b = next(it)
    assert ds.state_dict() == {"row": 2, "shard": "000000.jsonl", "record": 4, "listed": []}
    assert ds.step_report(1)["records"] == ["r0", "r1", "r2", "r3"]
    assert int((a != -100).sum()) > int((b != -100).sum()) > 0  # 3 sequences, then 1
    assert not ds.ready()  # nothing more until the next shard is renamed into place
    write_shard(tmp_path, 1, per_shard=7, first=4)  # rows of 3 + 3 + 1: one step, and a row left over
    assert ds.ready()
    next(it), next(it)
    assert ds.state_dict() == {"row": 4, "shard": "000001.jsonl", "record": 6, "listed": ["000000.jsonl"]}
    assert ds.step_report(2)["records"] == ["r4", "r5", "r6", "r7", "r8", "r9"]


def test_state_round_trip_continues_with_the_next_record(tmp_path):
    for i in range(3):
        write_shard(tmp_path, i, per_shard=6)
    ds = _rows(tmp_path)
    it = iter(ds)
    next(it), next(it)
    first = ds.step_report(1)["records"]
    state = ds.state_dict()
    again = _rows(tmp_path)
    again.load_state_dict(state)
    it2 = iter(again)
    next(it2), next(it2)
    assert again.step_report(2)["records"] == ["r6", "r7", "r8", "r9", "r10", "r11"]
    assert first == ["r0", "r1", "r2", "r3", "r4", "r5"]


def test_stale_records_are_dropped_and_counted(tmp_path):
    write_shard(tmp_path, 0, per_shard=6, version=0)
    write_shard(tmp_path, 1, per_shard=6, version=3)
    ds = _rows(tmp_path, max_lag=1)
    ds._g = 8  # as if 4 steps were trained: step 5 trains on version 4 (publish off: the steps done)
    ds.pos = ("000000.jsonl", 0)
    assert ds.ready()
    it = iter(ds)
    next(it), next(it)
    r = ds.step_metrics(5)
    assert r["data/dropped_stale"] == 6.0 and r["data/lag_max"] == 1.0 and r["data/version"] == 4.0
    assert "version 4" in ds.waiting_note()


def test_trainer_version_follows_publication():
    ds = FollowRows("/nonexistent", seq_len=8, dp_rank=0, dp_world_size=1, local_batch=1, global_batch=1,
                    publish_interval=4)
    assert [ds.version(s) for s in (1, 4, 5, 8, 9)] == [0, 0, 4, 4, 8]


def test_two_ranks_deal_the_same_rows_as_one(tmp_path):
    for i in range(2):
        write_shard(tmp_path, i, per_shard=6)
    one = _rows(tmp_path, local_batch=2, global_batch=4)
    r0 = _rows(tmp_path, local_batch=1, global_batch=4, dp_world_size=2, dp_rank=0)
    r1 = _rows(tmp_path, local_batch=1, global_batch=4, dp_world_size=2, dp_rank=1)
    whole = [next(iter_) for iter_ in [iter(one)] for _ in range(2)]
    i0, i1 = iter(r0), iter(r1)
    dealt = [next(i0), next(i1), next(i0), next(i1)]
    # global row g goes to rank (g // local_batch) % dp: rows 0, 2 on rank 0; 1, 3 on rank 1
    assert torch.equal(dealt[0][1], whole[0][1]) and torch.equal(dealt[1][1], whole[1][1])
    assert r0.state_dict() == r1.state_dict()


def test_malformed_shard_names_file_and_line(tmp_path):
    write_shard(tmp_path, 0, per_shard=6, bad_line=3)
    with pytest.raises(ValueError, match=r"000000\.jsonl:3"):
        _rows(tmp_path).ready()


# ------------------------------------------------------------------ the trainer, as a user runs it


def test_kill_9_mid_stream_then_resume_trains_every_record_exactly_once(tmp_path, capsys):
    data, run = tmp_path / "shards", tmp_path / "run"
    data.mkdir()
    written = []
    for i in range(3):
        written += write_shard(data, i)  # 6 records = rows of 3 + 3 = one step each
    argv = [*ARGS, f"data.path={data}", f"output_dir={run}", "training.steps=9", "data.wait_timeout=60"]
    proc = start(argv, tmp_path)
    wait_until(lambda: len(ledger(run)) >= 3, proc)  # steps 1-3 done, checkpoint at step 2
    for i in range(3, 5):  # the generator keeps writing while the trainer runs
        written += write_shard(data, i)
    time.sleep(0.3)
    proc.kill()  # kill -9: no checkpoint beyond the last regular one
    proc.wait()
    trained_before = [r for rec in ledger(run) for r in rec["records"]]
    for i in range(5, 9):
        written += write_shard(data, i)
    res = train_here(["train", *_set(argv, "checkpoint.resume=true", "data.wait_timeout=2")], tmp_path, capsys)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]  # 9 shards fill the 9 steps
    assert (run / "rollouts.superseded.jsonl").is_file()  # the killed run's steps past step 2, moved aside
    steps = ledger(run)
    assert [s["step"] for s in steps] == list(range(1, 10))
    trained = [r for s in steps for r in s["records"]]
    assert sorted(trained, key=lambda r: int(r[1:])) == trained, "records out of the written order"
    assert len(trained) == len(set(trained)), "a record trained twice"
    assert trained == written, "a record skipped"
    assert len(trained_before) > 12  # the killed run had trained past its last checkpoint (step 2)


def test_sigterm_while_waiting_checkpoints_and_exits_75_then_resume_continues(tmp_path, capsys):
    data, run = tmp_path / "shards", tmp_path / "run"
    data.mkdir()
    write_shard(data, 0)
    argv = _set(ARGS, f"data.path={data}", f"output_dir={run}", "training.steps=4", "checkpoint.interval=10")
    proc = start(argv, tmp_path)
    lines = []

    def waiting() -> bool:
        line = proc.stdout.readline()
        lines.append(line)
        return "waiting for rollouts in" in line

    wait_until(waiting, proc)
    assert f"waiting for rollouts in {data}:" in lines[-1] and "(step 2" in lines[-1]
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 75, "".join(lines) + out
    assert (run / "checkpoint" / "step-1").is_dir()  # off the interval: saved because it stopped
    assert "stopped on a signal while waiting for rollouts; checkpoint step-1 saved" in out
    write_shard(data, 1)
    res = train_here(["train", *argv, "checkpoint.resume=true", "data.wait_timeout=1"], tmp_path, capsys)
    assert res.returncode == 77, res.stdout[-3000:] + res.stderr[-3000:]  # step 3 never gets its rows
    assert "no rollouts for step 3" in res.stderr and "checkpoint step-2 saved" in res.stderr
    assert [s["records"] for s in ledger(run)] == [[f"r{i}" for i in range(6)], [f"r{i}" for i in range(6, 12)]]


def test_a_fresh_run_that_times_out_says_no_checkpoint_was_written(tmp_path, capsys):
    """The live recipe with no generator (was: "the checkpoint it started from stays" though none
    existed, then torchtitan's "Ran out of data; last step was canceled." after apiary's line)."""
    res = train_here(["train", "recipe=debug_grpo_live", "output_dir=live/run", "training.steps=8", "data.wait_timeout=1"],
                     tmp_path, capsys)
    assert res.returncode == 77, res.stdout[-3000:] + res.stderr[-3000:]
    assert "no checkpoint was written (no step trained)" in res.stderr, res.stderr[-3000:]
    assert "checkpoint it started from" not in res.stderr and "Ran out of data" not in res.stderr + res.stdout
    assert not (tmp_path / "live" / "run" / "checkpoint").exists() or not any((tmp_path / "live/run/checkpoint").iterdir())


def test_the_waiting_line_grows_its_interval_when_not_a_terminal():
    """Not a terminal (was: every 10 s, 61 lines in 10 minutes): at 10, 30, 60 s, then every 60 s; a
    terminal keeps 1 s, then every 10 s. The "Ran out of data" filter drops that line once, nothing else."""
    import logging

    from framework.train import follow

    def said(tty, until):
        out, at = [], follow.next_note_s(-1, tty)
        while at <= until:
            out.append(at)
            at = follow.next_note_s(at, tty)
        return out

    assert said(False, 600) == [10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600]
    assert said(True, 35) == [1, 11, 21, 31]
    root, seen = logging.getLogger(), []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    keep = Keep()
    earlier = [f for f in root.filters if isinstance(f, follow._RanOutOnce)]  # left by an in-process stop before
    for f in earlier:
        root.removeFilter(f)
    filters = list(root.filters)
    root.addHandler(keep)
    try:
        root.addFilter(follow._RanOutOnce())
        root.warning("something else")
        root.warning(follow.RAN_OUT)
        root.warning(follow.RAN_OUT)
    finally:
        root.removeHandler(keep)
    assert seen == ["something else", follow.RAN_OUT] and root.filters == filters


def test_malformed_shard_stops_with_the_position_kept(tmp_path, capsys):
    data, run = tmp_path / "shards", tmp_path / "run"
    data.mkdir()
    write_shard(data, 0)
    write_shard(data, 1, bad_line=2)
    argv = _set(ARGS, f"data.path={data}", f"output_dir={run}", "training.steps=2", "checkpoint.interval=10")
    res = train_here(["train", *argv], tmp_path, capsys)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"{data / '000001.jsonl'}:2" in res.stderr and "checkpoint step-1 saved" in res.stderr
    write_shard(data, 1)  # fixed (rewritten whole)
    res = train_here(["train", *argv, "checkpoint.resume=true"], tmp_path, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [s["step"] for s in ledger(run)] == [1, 2]
    assert ledger(run)[1]["records"] == [f"r{i}" for i in range(6, 12)]


@pytest.mark.parametrize("extra, key", [
    (["data.format=text", "loss=ce"], "data.follow=true"),
    (["data.num_workers=1"], "data.num_workers=1"),
    (["data.wait_timeout=0"], "data.wait_timeout=0"),
    (["rl.max_lag=-1"], "rl.max_lag=-1"),
])
def test_bad_follow_settings_stop_before_launch(tmp_path, extra, key):
    res = run_cli([*ARGS, f"data.path={tmp_path / 'd'}", f"output_dir={tmp_path / 'run'}", *extra], tmp_path,
                  timeout=120)
    assert res.returncode == 2 and key in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_max_lag_without_follow_is_refused(tmp_path):
    res = run_cli(["recipe=debug_grpo", "rl.max_lag=1", f"output_dir={tmp_path / 'run'}"], tmp_path, timeout=120)
    assert res.returncode == 2 and "rl.max_lag=1" in res.stderr and "data.follow=true" in res.stderr


def test_follow_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text("")
    res = run_cli([*ARGS, f"data.path={f}", f"output_dir={tmp_path / 'run'}"], tmp_path, timeout=120)
    assert res.returncode == 2 and "is a file" in res.stderr


def test_a_shard_deleted_before_it_was_read_is_named_and_listed(tmp_path, monkeypatch, capsys):
    from components.data import follow

    write_shard(tmp_path, 0, per_shard=6)
    write_shard(tmp_path, 2, per_shard=6, first=6)
    listed = follow.ready_shards(tmp_path) + [tmp_path / "000001.jsonl"]  # listed, gone when opened
    monkeypatch.setattr(follow, "ready_shards", lambda d: sorted(listed, key=lambda p: p.name))
    ds = _rows(tmp_path, global_batch=4, local_batch=4)
    assert ds.ready()
    it = iter(ds)
    for _ in range(4):
        next(it)
    report = ds.step_report(1)
    assert report["missing_shards"] == ["000001.jsonl"] and len(report["records"]) == 12
    assert "000001.jsonl was deleted before it was read" in capsys.readouterr().out


def test_a_shard_named_before_the_position_is_not_trained_and_named(tmp_path, capsys):
    write_shard(tmp_path, 1, per_shard=6)
    ds = _rows(tmp_path)
    it = iter(ds)
    next(it), next(it)
    write_shard(tmp_path, 0, per_shard=6, first=100)  # a generator restarted its counter
    write_shard(tmp_path, 2, per_shard=6)  # new records (r12-r17; a copy of shard 1 would not train again)
    next(it), next(it)
    assert ds.step_report(2)["records"] == [f"r{i}" for i in range(12, 18)]
    assert "000000.jsonl appeared after the trainer passed its name" in capsys.readouterr().out


@pytest.mark.slow  # about 50 s: a seed checkpoint and two runs; the dealing itself: test_two_ranks_deal_the_same_rows_as_one
def test_two_ranks_follow_the_same_stream_as_one(tmp_path):
    """nproc=2 (data parallel over 2 CPU ranks): the same records per step as one rank, and the same
    losses within the cross-rank tolerance (every rank reads the shards; rows are dealt in blocks)."""
    data = tmp_path / "shards"
    data.mkdir()
    for i in range(3):
        write_shard(data, i)
    common = _set(ARGS, f"data.path={data}", "training.steps=3", "training.global_batch=2", "training.local_batch=1",
              "data.wait_timeout=30", "checkpoint.interval=100")
    seed = run_cli([*common, "checkpoint.create_seed=true", f"output_dir={tmp_path / 'seed'}"], tmp_path, timeout=300)
    assert seed.returncode == 0, seed.stderr[-2000:]
    common.append(f"checkpoint.load_path={tmp_path / 'seed' / 'checkpoint' / 'step-0'}")  # the same initial weights
    one = run_cli([*common, f"output_dir={tmp_path / 'one'}"], tmp_path, timeout=300, env={"OMP_NUM_THREADS": "1"})
    two = run_cli([*common, f"output_dir={tmp_path / 'two'}", "nproc=2"], tmp_path, timeout=300,
                  env={"OMP_NUM_THREADS": "1"})
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-3000:])
    assert [s["records"] for s in ledger(tmp_path / "one")] == [s["records"] for s in ledger(tmp_path / "two")]
    assert [s["records"] for s in ledger(tmp_path / "two")] == [[f"r{i}" for i in range(6 * k, 6 * k + 6)]
                                                                for k in range(3)]
    loss = [[json.loads(x)["loss"] for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
            for r in ("one", "two")]
    assert all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(*loss)), loss


def test_parquet_shards_are_followed_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = [dict(RECORDS[i], sequence_id=f"p{i}") for i in range(6)]
    tmp = tmp_path / ".000000.parquet"
    pq.write_table(pa.Table.from_pylist(recs), tmp)
    assert not _rows(tmp_path).ready()  # a dot-file: not yet a shard
    tmp.rename(tmp_path / "000000.parquet")
    ds = _rows(tmp_path)
    assert ds.ready()
    it = iter(ds)
    next(it), next(it)
    assert ds.step_report(1)["records"] == [f"p{i}" for i in range(6)]


def test_followed_shards_train_like_the_same_files_read_at_once(tmp_path, capsys):
    """The baseline pair: shards that each hold whole rows (6 records = 2 rows of 3), followed, give
    the static reader's rows and so the same losses and grad norms, bit for bit (one process)."""
    data = tmp_path / "shards"
    data.mkdir()
    for i in range(2):
        write_shard(data, i)
    common = ["recipe=debug_grpo", "training.local_batch=2", "training.steps=2", "checkpoint.enable=false",
              "logging.tensorboard=false", f"data.path={data}"]
    static, follow = (train_here(["train", *common, *extra], tmp_path, capsys)
                      for extra in ([f"output_dir={tmp_path / 'static'}"],
                                    ["data.follow=true", "data.wait_timeout=5", f"output_dir={tmp_path / 'follow'}"]))
    assert static.returncode == 0 and follow.returncode == 0, (static.stderr[-2000:], follow.stderr[-2000:])
    m = [[(r["loss"], r["grad_norm"]) for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())]
         for d in ("static", "follow")]
    assert len(m[0]) == 2 and m[0] == m[1]
