"""Newcomer pass 8 (data): a rollout shard renamed into place, before the position, while a followed
run was stopped is named on resume (docs/skills/follow.md)."""

from __future__ import annotations

from test_follow import _rows, write_shard


def test_a_shard_renamed_before_the_position_while_stopped_is_named_on_resume(tmp_path, capsys):
    write_shard(tmp_path, 1, per_shard=6)  # one step of 2 rows of 3 records
    (tmp_path / "000000.jsonl.tmp").write_text("still being written\n")
    ds = _rows(tmp_path)
    it = iter(ds)
    next(it), next(it)
    state = ds.state_dict()  # the checkpoint; the run then stops (exit 77 on the wait timeout)
    (tmp_path / "000000.jsonl.tmp").unlink()
    write_shard(tmp_path, 0, per_shard=6, first=100)  # the writer finishes the shard it had started
    write_shard(tmp_path, 2, per_shard=6)
    capsys.readouterr()
    again = _rows(tmp_path)
    again.load_state_dict(state)
    it2 = iter(again)
    next(it2), next(it2)
    out = capsys.readouterr().out
    assert "000000.jsonl appeared while the trainer was stopped" in out and "not trained" in out
    assert again.step_report(2)["records"] == [f"r{i}" for i in range(12, 18)]
    assert again.state_dict()["listed"] == ["000000.jsonl", "000001.jsonl"]  # named once: not again on the next resume
    write_shard(tmp_path, 3, per_shard=6, first=100)  # a copy of the untrained shard, in order: trained, not a duplicate
    next(it2), next(it2)
    assert again.step_report(3)["records"] == [f"r{i}" for i in range(100, 106)]
