"""The fresh pass of bad inputs (docs/bad_inputs_third_pass.md, benchmarks/bad_inputs_third_pass.py):
the policy objectives' numbers, the mismatch threshold and the engine's wait are refused before launch
when they are not finite or out of range (they were accepted, NaN passing every comparison); then the
cases the pass found and left: a pipeline microbatch that does not divide the batch, `--cfg job`
printing jobs the launch refuses, publishing into another run's folder, follow settings that would do
nothing, a publish interval beyond the run, the wait for part of a step, group_id's documented type."""

from __future__ import annotations

import json

import pytest

from framework.errors import UserError
from framework.resolve.resolver import resolve

from conftest import ROOT


@pytest.mark.parametrize("overrides, match", [
    (["loss.eps=-0.2"], "loss.eps must be >= 0"),
    (["loss.eps=nan"], "loss.eps must be a finite number"),
    (["loss.kl_coef=-1"], "loss.kl_coef must be >= 0"),
    (["loss.kl_coef=nan"], "loss.kl_coef must be a finite number"),
    (["loss.temperature=nan"], "loss.temperature must be a finite number"),
    (["loss.temperature=inf"], "loss.temperature must be a finite number"),
    (["loss.entropy_coef=inf"], "loss.entropy_coef must be a finite number"),
    (["loss=dapo", "loss.eps_high=-0.28"], "loss.eps_high must be >= 0"),
    (["loss=gspo", "loss.eps_low=-1"], "loss.eps_low must be >= 0"),
    (["loss=cispo", "loss.eps_low=nan"], "loss.eps_low must be a finite number"),
    (["loss=ppo", "loss.eps=inf"], "loss.eps must be a finite number"),
    (["rl.mismatch_threshold=inf"], "rl.mismatch_threshold=inf: must be a finite number"),
])
def test_policy_numbers_out_of_range_are_refused(overrides, match):
    with pytest.raises(UserError, match=match):
        resolve("debug_grpo", overrides, world_size=1, for_training=False)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_an_engine_wait_that_is_not_finite_is_refused(value):
    with pytest.raises(UserError, match=rf"publish.engine_timeout={value}: must be a finite number > 0"):
        resolve("debug_grpo_vllm", [f"publish.engine_timeout={value}"], world_size=1, for_training=False)


def test_the_defaults_and_cispo_without_a_lower_clip_still_resolve():
    resolve("debug_grpo", [], world_size=1, for_training=False)
    resolve("debug_grpo", ["loss.eps=1e9"], world_size=1, for_training=False)  # no clipping: a control run
    resolve("debug_grpo", ["loss=cispo", "loss.eps_high=5"], world_size=1, for_training=False)


# ------------------------------------------------------------------ the cases found, not fixed at first


def test_a_pipeline_microbatch_that_does_not_divide_the_local_batch_is_refused():
    """Cases 100/114: was accepted by `--cfg job` and ended the launch in torchrun's ChildFailedError."""
    with pytest.raises(UserError, match=r"parallel.pp_microbatch_size=3: training.local_batch=4 is not a multiple "
                                        r"of it.*among \[1, 2, 4\]"):
        resolve("debug_moe", ["parallel.pp=2", "parallel.pp_microbatch_size=3"], world_size=2, for_training=False)
    resolve("debug_moe", ["parallel.pp=2", "parallel.pp_microbatch_size=2"], world_size=2, for_training=False)


@pytest.mark.parametrize("recipe, overrides, match", [
    ("debug_moe", ["parallel.pp=2", "publish.interval=1"], r"publish.interval=1: with parallel.pp=2 each rank holds "
                                                           "one pipeline stage"),
    ("debug_grpo", ["parallel.pp=2"], r"data.format=rollouts: policy training runs without pipeline parallelism"),
    ("debug_grpo_vllm", ["data.path=roll", "publish.dir=w", "parallel.pp=2"], "without pipeline parallelism"),
])
def test_cfg_job_refuses_what_the_launch_refuses(recipe, overrides, match):
    """Cases 83/107: `--cfg job` (a print-only resolve) runs the launch's own checks of these."""
    with pytest.raises(UserError, match=match):
        resolve(recipe, overrides, world_size=2, for_training=False)


def _version(folder, v: int, run) -> None:
    step = folder / f"step-{v}"
    step.mkdir(parents=True)
    (step / "apiary_version.json").write_text(json.dumps({"version": v, "step": v, "run": str(run)}))
    (folder / "latest").write_text(f"step-{v}\n")


PUBLISH_RUN = ["publish.interval=1", "training.steps=1", "checkpoint.enable=false"]


def test_publishing_into_another_runs_publish_dir_is_refused(workdir):
    """Case 87: the other run's versions were pruned and replaced without a word."""
    pub = workdir / "pubcopy"
    for v in (0, 2):
        _version(pub, v, workdir / "other_run")
    with pytest.raises(UserError, match=r"publish.dir=.*pubcopy: holds weight versions another run published: "
                                        r"step-0, step-2, whose apiary_version.json names the run .*other_run") as e:
        resolve("debug_moe", [*PUBLISH_RUN, f"publish.dir={pub}", "output_dir=mine"], world_size=1)
    assert "a publish.dir of its own" in str(e.value) and f"delete {pub}" in str(e.value)
    assert sorted(p.name for p in pub.iterdir()) == ["latest", "step-0", "step-2"]  # nothing touched


def test_the_same_run_and_its_own_folder_still_publish_there(workdir):
    """A resume (the same output_dir) keeps publishing into its publish.dir; a run folder moved since
    keeps its OUTPUT_DIR/weights; a folder of another program's step-N (no version file) is not a run's."""
    pub = workdir / "shared_weights"
    _version(pub, 0, workdir / "mine")
    resolve("debug_moe", [*PUBLISH_RUN, f"publish.dir={pub}", "output_dir=mine"], world_size=1)
    _version(workdir / "moved" / "weights", 0, workdir / "before_the_move")
    resolve("debug_moe", [*PUBLISH_RUN, "output_dir=moved"], world_size=1)
    (workdir / "plain" / "step-3").mkdir(parents=True)
    resolve("debug_moe", [*PUBLISH_RUN, f"publish.dir={workdir / 'plain'}", "output_dir=third"], world_size=1)


LIVE = ["data.path=roll", "publish.dir=w"]


@pytest.mark.parametrize("overrides, match", [
    (["data.sharding=documents"], r"data.sharding=documents: .*rollout rows are always dealt in blocks"),  # case 52
    (["validation.interval=2", "validation.fraction=0.1"],  # case 53
     r"validation.interval=2 validation.fraction=0.1: .*a followed stream has no end, so no last fraction"),
    (["data.name=allenai/c4"], r"data.name=allenai/c4: sets the dataset a run reads when it does not follow a "
                               r"folder \(a followed folder is read from data.path alone\).*would be ignored"),  # case 55
    (["data.path=s3://bucket/rollouts"], r"data.path=s3://bucket/rollouts: is a URL; .*local folder named "
                                         r"s3:/bucket/rollouts"),  # case 59
    (["rl.max_lag=99999999999999999999"], r"rl.max_lag=99999999999999999999: must be an integer from 0 to "
                                          r"2\*\*63-1.*rl.max_lag=null"),  # case 49
    (["data.wait_timeout=inf"], r"data.wait_timeout=inf: must be a finite number of seconds > 0.*1e9"),  # case 51
    (["data.wait_timeout=nan"], r"data.wait_timeout=nan: must be a finite number of seconds > 0"),
])
def test_follow_settings_that_would_do_nothing_are_refused(overrides, match):
    with pytest.raises(UserError, match=match):
        resolve("debug_grpo_live", [*LIVE, *overrides], world_size=1, for_training=False)


def test_a_data_name_the_recipe_keeps_for_its_text_is_left_alone():
    """Only a data.name given with data.follow=true is refused: a recipe's own (qwen35_35b_128k streams
    allenai/c4) stays for the times it trains text, as docs/skills/routing_replay.md's command does."""
    resolve("qwen35_35b_128k", ["loss=grpo", "data.format=rollouts", "data.follow=true", "data.path=roll"],
            for_training=False)


def test_a_data_name_given_with_a_rollout_path_is_refused():
    """A hub data.name given with data.format=rollouts, not followed (was: accepted, the rollouts read from
    data.path alone): refused naming the key, the format and the fix (the format's ``ignored_keys``). The
    recipe's own data.name (docs/skills/routing_replay.md's command), data.name=packaged without data.path
    (the packaged rollouts) and data.path alone stay accepted."""
    from components.data.rollouts import PACKAGED_ROLLOUTS

    path = f"data.path={PACKAGED_ROLLOUTS}"
    with pytest.raises(UserError, match=r"data.name=allenai/c4 with data.format=rollouts: this data format does not "
                                        r"read data.name: rollouts are read from data.path=.* alone.*would be ignored"
                                        r".*Drop data.name"):
        resolve("debug_grpo", [path, "data.name=allenai/c4"], world_size=1, for_training=False)
    resolve("debug_grpo", [path], world_size=1, for_training=False)
    resolve("debug_grpo", ["data.name=packaged"], world_size=1, for_training=False)
    resolve("qwen35_35b_128k", ["loss=grpo", "data.format=rollouts", path], for_training=False)


def test_a_publish_interval_beyond_the_run_is_refused():
    """Case 86: only the starting weights were published. A run given its whole length in lr.total_steps
    (to be extended by resumes) publishes once it passes the interval: accepted."""
    with pytest.raises(UserError, match=r"publish.interval=100 with training.steps=2: publishes every 100 steps, "
                                        r"and the run ends at step 2.*publish.interval=2 or less"):
        resolve("debug_moe", ["publish.interval=100", "training.steps=2"], world_size=1, for_training=False)
    resolve("debug_moe", ["publish.interval=100", "training.steps=2", "lr.total_steps=200"], world_size=1,
            for_training=False)
    resolve("debug_moe", ["publish.interval=2", "training.steps=2"], world_size=1, for_training=False)


def test_a_followed_folder_holding_part_of_a_step_says_how_much(tmp_path, capsys):
    """Case 61: the waiting line and the exit-77 paragraph said "no rollouts for step 1" though a shard
    had been read; a shard smaller than a step never trains (rows never span shards)."""
    from types import SimpleNamespace

    from torchtitan.components.dataloader import DataloaderExhaustedError

    from components.data.follow import FollowRows
    from framework.train.trainer import ApiaryTrainer  # reason: imports torchtitan (slow)

    recs = [{"input_ids": [1 + i % 7] * 24, "loss_mask": [0] + [1] * 23, "old_logprobs": [-1.0] * 24,
             "advantages": 0.5, "sequence_id": f"s{i}"} for i in range(16)]  # 16 x 24 tokens: rows of 10 + 6
    (tmp_path / "000000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ds = FollowRows(str(tmp_path), seq_len=256, dp_rank=0, dp_world_size=1, local_batch=4, global_batch=4)
    assert not ds.ready()
    said = "the folder holds 2 of the 4 rows of step 1 (1 shard read, 16 records, 384 tokens)"
    assert said in ds.held() and said in ds.waiting_note() and "rows never span shards" in ds.held()
    trainer = object.__new__(ApiaryTrainer)  # the wait alone: no model, one rank
    trainer.dataloader, trainer.device, trainer.step, trainer._start_step = SimpleNamespace(dataset=ds), "cpu", 1, 0
    trainer.config = SimpleNamespace(follow_wait_timeout=0.01, resume_hint=None)
    trainer.checkpointer = SimpleNamespace(enable=False)
    flushed = []  # publish.when_busy=skip: a deferred version goes before the wait (the engine may need it), once
    trainer._publisher = SimpleNamespace(flush=lambda t: flushed.append(t.step))
    with pytest.raises(DataloaderExhaustedError):  # how the wait ends torchtitan's loop
        trainer._wait_for_data()
    assert flushed == [1]
    assert trainer.follow_stop.why == "timeout" and trainer.follow_stop.exit_code == 77
    err = capsys.readouterr().err
    assert f"not enough rollouts for step 1 in {tmp_path} after 0 s (data.wait_timeout=0.01): {said}" in err, err
    assert "no rollouts for step" not in err


def test_group_id_is_an_integer_or_a_string_as_the_record_table_says(tmp_path):
    """Case 16: docs/rl.md said group_id may be "any"; the reader refuses an object, naming the field."""
    from components.data.rollouts import RolloutIndex

    rec = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "old_logprobs": [-1.0] * 3, "advantages": 0.5}
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({**rec, "group_id": {"prompt": 3}}) + "\n")
    with pytest.raises(ValueError, match=rf"{f}:1: group_id must be an integer or a string, got \{{'prompt': 3\}}"):
        RolloutIndex(str(f), validate=True, vocab_size=320)
    for ok in (7, "p3"):
        f.write_text(json.dumps({**rec, "group_id": ok}) + "\n")
        RolloutIndex(str(f), validate=True, vocab_size=320)
    row = next(line for line in (ROOT / "docs" / "rl.md").read_text().splitlines() if line.startswith("| `group_id`"))
    kind, allowed = row.split("|")[2].strip(), row.split("|")[3]
    assert kind == "integer or string" and "an object" in allowed and "is refused" in allowed, row
