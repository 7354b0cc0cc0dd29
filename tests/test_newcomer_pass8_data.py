"""Newcomer pass 8 (data): a rollout shard renamed into place, before the position, while a followed
run was stopped is named on resume (docs/skills/follow.md); a resume keeps the warm-up a short launch
shortened (docs/skills/resume.md); a followed run's validation.* keys are refused first for what they are."""

from __future__ import annotations

from test_follow import _rows, write_shard

from conftest import read_metrics, run_cli, train_here


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


WARM_RECIPE = ("defaults:\n  - debug_moe\n  - _self_\ntraining:\n  seq_len: 64\n  local_batch: 2\n"
               "lr:\n  warmup_steps: 50\n  min_lr_factor: 1.0\n")  # a long warm-up, then a constant lr


def test_a_resume_keeps_the_warm_up_a_short_launch_shortened(tmp_path, capsys):
    (tmp_path / "warm.yaml").write_text(WARM_RECIPE)
    first = train_here(["train", "recipe=warm.yaml", "output_dir=run", "training.steps=3", "checkpoint.interval=3",
                        "logging.tensorboard=false"], tmp_path, capsys)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "warm-up shortened to 2 steps" in first.stdout
    resume_cmd = next(line.split("resume", 1)[1].split() for line in first.stdout.splitlines()
                      if line.strip().startswith("resume ") and "checkpoint.resume=true" in line)
    assert resume_cmd[0] == "train" and "lr.warmup_steps=2" in resume_cmd, resume_cmd
    # another warm-up given is refused, naming the one the schedule used (was: resumed into a warm-up of 5)
    other = train_here([*(x for x in resume_cmd if not x.startswith("lr.warmup_steps=")), "lr.warmup_steps=5"],
                       tmp_path, capsys)
    assert other.returncode == 2 and "lr.warmup_steps: 2 then, 5 now" in other.stderr, other.stderr[-2000:]
    # a resume typed without it keeps it, as it keeps the launch's overrides
    second = train_here([x for x in resume_cmd if not x.startswith("lr.warmup_steps=")], tmp_path, capsys)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "lr.warmup_steps=2" in second.stdout, second.stdout[-2000:]
    assert "warm-up shortened" not in second.stdout
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run")]
    peak = max(lrs[:3])
    assert len(lrs) == 6 and lrs[2] == peak and all(lr >= peak * (1 - 1e-9) for lr in lrs[3:]), lrs


def test_validation_steps_on_a_rollout_run_is_refused_for_what_it_is(tmp_path):
    """`recipe=debug_grpo validation.steps=3` first asked for validation.interval=N, which was refused next
    for a rollout run: the first refusal says validation does not apply and to drop the validation keys."""
    r = run_cli(["train", "recipe=debug_grpo", "validation.steps=3", "--cfg", "job"], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Drop the validation.* keys" in r.stderr and "validation.interval=N" not in r.stderr, r.stderr[-2000:]
    assert "validation.steps=3" in r.stderr and "trains a policy on rollouts" in r.stderr
