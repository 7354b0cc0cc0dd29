"""RL on the console: the records' optional `reward` carried through the data loader into each
step's metrics (`data/reward_mean`, followed shards and a static rollout file), the progress line
(reward, lag, mismatch, KL), the summary (the reward's first/last/best instead of a "best loss")
and `apiary plot`'s RL panels; in process, on synthetic records and run folders. One short CPU
run of `recipe=debug_grpo` on rewarded records checks the whole path into metrics.jsonl."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from components.data.follow import FollowRows
from components.data.rollout_loader import RolloutRows
from components.data.rollouts import record_reward
from framework.report import progress, summary
from toolkit import plot

from conftest import ROOT, run_cli

PACKAGED = ROOT / "components" / "data" / "tiny_rollouts.jsonl"  # 82-token records: 3 per 256-token row
RECORDS = [json.loads(line) for line in PACKAGED.read_text().splitlines() if line.strip()]


def _write(path: Path, rewards: list, version: int | None = None) -> Path:
    lines = []
    for j, r in enumerate(rewards):
        rec = dict(RECORDS[j % len(RECORDS)], sequence_id=f"{path.stem}-{j}")
        if r is not None:
            rec["reward"] = r
        if version is not None:
            rec["policy_version"] = version
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_record_reward_reads_a_finite_number_only():
    assert record_reward({"reward": 1}) == 1.0 and record_reward({"reward": -0.25}) == -0.25
    for bad in (None, True, "0.5", [1.0], float("nan"), float("inf")):
        assert record_reward({"reward": bad}) is None, bad
    assert record_reward({}) is None


def test_followed_step_metrics_carry_the_mean_reward_of_the_steps_records(tmp_path):
    # 6 records of 82 tokens: two rows of 3 = one step of global_batch 2; a record without a reward,
    # and one whose reward is not a number, are not counted
    _write(tmp_path / "000000.jsonl", [1.0, 0.0, None, 0.5, "high", 0.25], version=0)
    _write(tmp_path / "000001.jsonl", [0.0] * 6, version=1)
    ds = FollowRows(str(tmp_path), seq_len=256, dp_rank=0, dp_world_size=1, local_batch=2, global_batch=2)
    it = iter(ds)
    next(it), next(it)
    m = ds.step_metrics(1)
    assert m["data/reward_mean"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.25) / 4)
    assert ds.step_report(1)["reward_mean"] == m["data/reward_mean"]  # the ledger's line too
    next(it), next(it)
    assert ds.step_metrics(2)["data/reward_mean"] == 0.0


def test_followed_records_without_a_reward_log_none(tmp_path):
    _write(tmp_path / "000000.jsonl", [None] * 6)
    ds = FollowRows(str(tmp_path), seq_len=256, dp_rank=0, dp_world_size=1, local_batch=2, global_batch=2)
    it = iter(ds)
    next(it), next(it)
    assert "data/reward_mean" not in ds.step_metrics(1) and "reward_mean" not in ds.step_report(1)


def test_static_rollouts_step_metrics_are_the_steps_rows_on_every_rank(tmp_path):
    f = _write(tmp_path / "r.jsonl", [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, None])  # rows of 3 records
    for rank in (0, 1):  # rank 1 of 2 reads other rows, and logs the same step means
        ds = RolloutRows(str(f), seq_len=256, dp_rank=rank, dp_world_size=2, local_batch=1, global_batch=2)
        assert ds.step_metrics(1) == {"data/reward_mean": 0.5}
        assert ds.step_metrics(2) == {"data/reward_mean": pytest.approx((0.5 + 0.5 + 1.0 * 3) / 5)}  # wraps round
    g = _write(tmp_path / "none.jsonl", [None] * 3)
    assert RolloutRows(str(g), seq_len=256, dp_rank=0, dp_world_size=1, local_batch=1,
                       global_batch=1).step_metrics(1) == {}


RL_REC = {"step": 3, "loss": 0.0123, "grad_norm": 0.5, "tokens_per_s": 900.0, "data/reward_mean": 0.53125,
          "data/lag_mean": 0.5, "data/lag_max": 1.0, "policy/mismatch_abs_mean": 0.00123, "policy/kl_mean": 0.0042}


def test_progress_line_shows_reward_lag_mismatch_and_kl():
    text = progress.step_text(RL_REC, 30)
    assert text.startswith("step     3/30  loss 0.0123  reward 0.5312  lag 0.5 (max 1)  mismatch 1.23e-03  "
                           "kl 4.20e-03  grad_norm 0.500"), text
    plain = progress.step_text({"step": 3, "loss": 2.0}, 30)
    assert "reward" not in plain and "lag" not in plain and "mismatch" not in plain
    p = progress.Progress(30, console=Console(file=io.StringIO(), width=200, color_system=None), live=False)
    p.log(RL_REC)
    assert "reward 0.5312" in p.live_text()


def _rl_run(tmp_path, records, cfg="recipe: debug_grpo_live\ntraining:\n  steps: 4\ndata:\n  format: rollouts\n"
                                  "loss:\n  name: grpo\n") -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text(cfg)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def _rec(step, loss, reward, lag, mism, waited=0.0):
    return {"step": step, "loss": loss, "elapsed_s": 10.0 * step, "tokens": 100, "data/reward_mean": reward,
            "data/lag_mean": lag, "data/lag_max": 1.0 if lag else 0.0, "policy/mismatch_abs_mean": mism,
            "policy/mismatch_abs_max": 10 * mism, "data/waited_s": waited}


def test_summary_of_an_rl_run_shows_the_reward_not_a_best_loss(tmp_path):
    recs = [_rec(1, 0.01, 0.07, 0.0, 1e-3, waited=37.2), _rec(2, -0.2, 0.5, 1.0, 2e-3),
            _rec(3, 0.3, 0.97, 0.5, 3e-3), _rec(4, -0.5, 0.9, 0.5, 2e-3, waited=1.0)]
    s = summary.summarize(_rl_run(tmp_path, recs))
    assert s["rl_objective"] is True
    assert (s["reward_first"], s["reward_last"], s["reward_best"], s["reward_best_step"]) == (0.07, 0.9, 0.97, 3)
    assert s["lag_mean"] == 0.5 and s["lag_max"] == 1.0 and s["rollout_wait_s"] == 38.2
    assert s["mismatch_abs_mean"] == pytest.approx(2e-3) and s["mismatch_abs_max"] == pytest.approx(3e-2)
    buf = io.StringIO()
    summary.render(s, Console(file=buf, width=200, color_system=None), color=False)
    text = buf.getvalue()
    assert "best -0.5" not in text and "loss          first 0.0100 · last -0.5000 (a policy objective" in text
    for line in ("reward        first 0.07 · last 0.9 · best 0.97 (step 3;",
                 "lag           mean 0.50 · max 1 versions behind the trainer",
                 "mismatch      mean |logp_gen - logp_train| 2.00e-03 · last 2.00e-03 · max 3.00e-02",
                 "rollout wait  0:38 (38.2 s waiting for rollout records"):
        assert line in text, (line, text)


def test_summary_of_an_rl_run_without_rewards_says_so_and_sft_keeps_best_loss(tmp_path):
    recs = [{"step": 1, "loss": 1.0, "policy/clip_low_frac": 0.0}, {"step": 2, "loss": 0.5, "policy/clip_low_frac": 0.0}]
    s = summary.summarize(_rl_run(tmp_path, recs, cfg="recipe: debug_grpo\ntraining:\n  steps: 2\n"))  # no data/loss
    assert s["rl_objective"] and s["reward_first"] is None
    assert ("reward", "n/a (the rollout records carry no reward field, docs/rl.md)") in summary.lines(s)
    (tmp_path / "run" / "config.yaml").write_text("recipe: x\ntraining:\n  steps: 2\ndata:\n  format: rollouts\n"
                                                  "loss:\n  name: sft\n")
    s = summary.summarize(tmp_path / "run")
    assert not s["rl_objective"] and ("loss", "first 1.0000 · last 0.5000 · best 0.5000 (step 2)") in summary.lines(s)


def test_plot_of_an_rl_run_adds_reward_lag_mismatch_and_kl_panels(tmp_path, capsys):
    recs = [dict(_rec(1, 0.01, 0.07, 0.0, 1e-3), grad_norm=1.0, tokens_per_s=10.0, peak_mem_bytes=2**30),
            dict(_rec(2, -0.2, 0.5, 1.0, 2e-3), grad_norm=1.0, tokens_per_s=10.0, peak_mem_bytes=2**30)]
    d = _rl_run(tmp_path, recs)
    out, drawn = plot.plot_runs([str(d)])
    assert list(drawn) == ["loss", "grad norm", "throughput", "peak memory", "reward", "lag (dashed: max)",
                           "training-inference mismatch", "KL to the reference"]
    assert drawn["reward"] == {"run (debug_grpo_live)": ([1, 2], [0.07, 0.5])}
    assert drawn["lag (dashed: max)"] == {"run (debug_grpo_live)": ([1, 2], [0.0, 1.0]),
                                          "run (debug_grpo_live) max": ([1, 2], [0.0, 1.0])}
    assert drawn["training-inference mismatch"]["run (debug_grpo_live)"][1] == pytest.approx([1e-3, 2e-3])
    assert drawn["KL to the reference"] == {}  # no KL term: the panel says so
    head = out.read_bytes()[:24]
    assert int.from_bytes(head[16:20], "big") == 1200 and int.from_bytes(head[20:24], "big") == 1600
    from toolkit.cli import apiary_main

    assert apiary_main(["plot", str(d)]) == 0 and "1200x1600" in capsys.readouterr().out


def test_debug_grpo_on_rewarded_rollouts_logs_the_reward_on_its_console(tmp_path):
    f = _write(tmp_path / "r.jsonl", [0.25 * (j % 5) for j in range(12)])  # 4 rows of 3: one row per step
    out = tmp_path / "run"
    res = run_cli(["train", "recipe=debug_grpo", f"data.path={f}", "training.steps=2", "training.local_batch=1",
                   f"output_dir={out}", "checkpoint.enable=false", "logging.tensorboard=false"],
                  cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["data/reward_mean"] for r in recs] == pytest.approx([0.25, 1.75 / 3])  # (0 + .25 + .5), (.75 + 1 + 0)
    assert "reward 0.25" in res.stdout and "reward 0.5833" in res.stdout
    assert "reward        first 0.25 · last 0.5833 · best 0.5833 (step 2" in res.stdout


def test_a_static_rollouts_file_gets_a_data_line(tmp_path):
    """data.path=FILE with data.format=rollouts, not followed: the run's first lines name it, as text
    runs and follow mode do (was: no `data:` line at all); the packaged rollouts too."""
    from framework.resolve.resolver import resolve

    path = _write(tmp_path / "mine.jsonl", [0.5, None, 1.0])
    r = resolve("debug_grpo", [f"data.path={path}"], world_size=1)
    first = r.data_summary.splitlines()[0]
    n_tokens = sum(len(rec["input_ids"]) for rec in RECORDS[:3])
    assert first == f"data: local rollouts {path}: 3 records, {n_tokens:,} tokens, a reward in 2", r.data_summary
    r = resolve("debug_grpo", [], world_size=1)
    assert r.data_summary.startswith(f"data: packaged rollouts {PACKAGED}: {len(RECORDS):,} records"), r.data_summary


def test_a_policy_loss_near_zero_prints_its_digits_and_no_negative_zero(tmp_path):
    """A GRPO step's loss sits near 0: the console printed `loss -0.0000` (a negative zero, no digits).
    Below 1e-3 a loss is printed with 3 significant digits in scientific notation; 0 and -0 as 0.0000;
    larger losses keep 4 decimals (the step line, the live line and the summary alike)."""
    assert [progress.loss_text(x) for x in (-0.0, 0.0, -4.2e-05, 3e-07, 0.0123, -0.5, 5.8078, float("nan"))] == [
        "0.0000", "0.0000", "-4.20e-05", "3.00e-07", "0.0123", "-0.5000", "5.8078", "nan"]
    rec = {**RL_REC, "loss": -4.2e-05}
    assert "loss -4.20e-05  reward" in progress.step_text(rec, 30)
    assert progress.step_text({"step": 1, "loss": -0.0}, 30).endswith("loss 0.0000")
    p = progress.Progress(30, console=Console(file=io.StringIO(), width=200, color_system=None), live=False)
    p.log(rec)
    assert "loss -4.20e-05" in p.live_text()
    s = summary.summarize(_rl_run(tmp_path, [_rec(1, -0.0, 0.07, 0.0, 1e-3), _rec(2, -4.2e-05, 0.1, 0.0, 1e-3)]))
    buf = io.StringIO()
    summary.render(s, Console(file=buf, width=200, color_system=None), color=False)
    assert "loss          first 0.0000 · last -4.20e-05 (a policy objective" in buf.getvalue(), buf.getvalue()
