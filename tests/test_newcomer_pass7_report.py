"""What the seventh newcomer pass reported (a user on CPU), each pinned here."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.compare import compare_main


def test_compare_probes_a_policy_loss_and_checks_its_step_0(tmp_path, capsys):
    """#1, #2: `apiary compare recipe=debug_grpo ...`: the step-0 probe called the trainer's
    forward_backward_step before the per-step sums a policy loss adds to existed (AttributeError:
    '_policy_sums'), so every variant's step-0 row was an error, and --check passed anyway. Now both
    probes give a step-0 loss and gradients, and --check compares them (exactly: recompute reruns the ops)."""
    out = tmp_path / "cmp"
    rc = compare_main(["recipe=debug_grpo", "recompute=none,full", "training.steps=2", "logging.tensorboard=false",
                       f"output_dir={out}", "--check", "--jobs=1"])
    capsys.readouterr()
    res = json.loads((out / "compare.json").read_text())
    base, var = res["variants"]
    for r in (base, var):
        assert r["status"] == "ok", r.get("log_tail")
        assert "error" not in r["probe"], r["probe"]["error"][:2000]
        assert r["probe"]["loss"] == r["probe"]["loss"] and r["probe"]["grad_norm"] > 0
        assert r["probe"]["grads"]["n_tensors"] > 10
        assert (Path(r["dir"]) / "probe" / "grads.pt").is_file()
        assert r["probe"]["step1_loss_abs_diff"] == 0.0  # the probe's step 0 is the run's step 1
    # the grpo loss runs lm_head itself: no logits, said so
    assert any("no logits" in n or "lm_head" in n for n in base["probe"]["notes"])
    d = var["diff"]
    assert d["step0_loss_abs"] == 0.0 and d["grads_rel"] == 0.0 and d["grads_n_params"] > 10
    assert rc == 0 and res["check"]["passed"], res["check"]


def _fake_run(error: str | None):
    """Stands in for compare's subprocess runner: the seed run writes a seed, each variant two identical
    metrics records and a probe.json (with ``error``, as toolkit.probe writes a failed probe)."""
    def run(cmd, log, timeout):
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("$ fake\n")
        out = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("output_dir=")))
        if "framework.cli" in cmd:  # the seed run
            (out / "checkpoint" / "step-0").mkdir(parents=True)
            (out / "checkpoint" / "step-0" / ".metadata").write_text("")
            return 0, 0.1, False
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": 5.0 - s, "grad_norm": 1.0, "step_time_s": 0.1}) + "\n" for s in (1, 2)))
        dump = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("--dump=")))
        dump.mkdir(parents=True, exist_ok=True)
        probe = {"error": error} if error else {"loss": 4.0, "grad_norm": 1.0, "notes": []}
        (dump / "probe.json").write_text(json.dumps(probe))
        return 0, 0.1, False
    return run


def test_check_fails_when_a_probe_failed(tmp_path, capsys, monkeypatch):
    """#2: a --check whose step-0 probe failed compared nothing at step 0, yet printed "check passed" and
    exited 0. Now it fails, naming the variant and the probe's error."""
    from toolkit.compare import running

    monkeypatch.setattr(running, "_run", _fake_run("AttributeError: simulated probe failure\nTraceback ..."))
    rc = compare_main(["recompute=none,full", "training.steps=2", f"output_dir={tmp_path / 'bad'}", "--check"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "check passed" not in text
    assert "check failed" in text and "the step-0 probe failed (AttributeError: simulated probe failure)" in text
    res = json.loads((tmp_path / "bad" / "compare.json").read_text())
    assert {f["metric"] for f in res["check"]["failures"]} == {"probe"}
    # the same runs with working probes pass
    monkeypatch.setattr(running, "_run", _fake_run(None))
    assert compare_main(["recompute=none,full", "training.steps=2", f"output_dir={tmp_path / 'ok'}", "--check"]) == 0
    assert "check passed" in capsys.readouterr().out


def test_step_time_is_over_the_steps_since_the_previous_record(monkeypatch):
    """#3: with logging.log_freq=3 step 1's step_time_s was its time / 3 and step 3's the time of steps 2-3
    / 3: torchtitan divides the time since its last log by log_freq. Now by the steps actually run since
    the previous record (or a validation, which restarts torchtitan's timer), from the first step this
    process ran (a resume starts later)."""
    from types import SimpleNamespace

    from torchtitan.components.metrics import MetricsProcessor

    from framework.report.metrics import ApiaryMetrics

    monkeypatch.setattr(MetricsProcessor, "log_validation", lambda self, loss, step, extra_metrics=None: None)

    def divisors(first, last, freq, validate_at=()):
        m = object.__new__(ApiaryMetrics)
        m.config = SimpleNamespace(log_freq=freq, total_steps=last)
        seen = []
        m._log = lambda step, *a, **k: seen.append((step, m.config.log_freq))
        for s in range(first, last + 1):  # what train_step does each step: ask, then log; then validation
            if m.should_log(s):
                m.log(s, 0.0, 0.0, 0.0)
            if s in validate_at:
                m.log_validation(0.0, s)
        assert m.config.log_freq == freq
        return seen

    assert divisors(1, 5, 3) == [(1, 1), (3, 2), (5, 2)]
    assert divisors(1, 10, 4) == [(1, 1), (4, 3), (8, 4), (10, 2)]
    assert divisors(7, 10, 3) == [(9, 3), (10, 1)]  # resumed after step 6: steps 7-9, then 10
    assert divisors(1, 9, 4, validate_at=(6,)) == [(1, 1), (4, 3), (8, 2), (9, 1)]


def test_logged_step_times_add_up_to_the_wall_clock(tmp_path, capsys):
    """#3, measured: each record's step_time_s x the steps since the previous one is the time between the
    records, and tokens_per_s is the tokens since then over that time."""
    from conftest import read_metrics, train_here

    res = train_here(["train", "logging.log_freq=3", "training.steps=5", "logging.tensorboard=false",
                      f"output_dir={tmp_path / 'run'}"], tmp_path, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    recs = read_metrics(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 3, 5]
    first = recs[0]
    assert first["step_time_s"] >= 0.9 * first["first_step_wall_s"]  # step 1 alone, not a third of it
    for prev, r in zip(recs, recs[1:]):
        steps = r["step"] - prev["step"]
        wall = r["elapsed_s"] - prev["elapsed_s"]
        assert abs(r["step_time_s"] * steps - wall) <= 0.15 * wall + 0.02, (r["step"], r["step_time_s"], steps, wall)
    for r, steps in zip(recs, (1, 2, 2)):
        assert abs(r["tokens_per_s"] * r["step_time_s"] * steps - r["tokens"]) <= 0.01 * r["tokens"], r


def test_summary_names_skipped_updates_and_its_best_loss_leaves_them_out(tmp_path):
    """#4: `train optimizer.lr=1e30 training.steps=4 training.on_nonfinite=skip` skipped 3 of 4 updates, yet the
    summary said `steps 4/4` and `best 5.7683 (step 2)`, a skipped step. Now the steps line says how many
    updates were skipped and which, and the best loss is of a step whose update was applied."""
    from test_summary import _rec, _run, _text

    from framework.report import summary

    def rec(step, loss, skipped, bad, norm=float("nan")):
        return {**_rec(step, loss, 1.0 + step, device="cpu"), "grad_norm": norm if bad else 1.0,
                "nonfinite": int(bad), "skipped_steps": skipped}

    records = [rec(1, 5.7984, 0, False), rec(2, 5.7683, 1, True), rec(3, 5.7683, 2, True), rec(4, 5.7683, 3, True)]
    s = summary.summarize(_run(tmp_path / "a", records, steps=4, checkpoints=(4,)))
    assert (s["skipped_updates"], s["skipped_steps_logged"]) == (3, [2, 3, 4])
    assert (s["loss_best"], s["loss_best_step"]) == (5.7984, 1)
    text = " ".join(_text(s).split())
    assert "steps 4/4 (3 of 4 updates skipped: non-finite loss or gradient norm, training.on_nonfinite=skip; " \
           "steps 2, 3, 4; the best loss leaves them out)" in text
    assert "best 5.7984 (step 1)" in text

    # logging.log_freq=3: a skip between records is counted, not named
    records = [rec(1, 6.0, 0, False), rec(3, 5.0, 2, True), rec(5, 5.5, 2, False)]
    s = summary.summarize(_run(tmp_path / "b", records, steps=5, checkpoints=(5,)))
    assert "2 of 5 updates skipped" in _text(s) and "step 3, 1 more between records" in " ".join(_text(s).split())
    assert s["loss_best_step"] == 5

    # no skips: nothing said
    s = summary.summarize(_run(tmp_path / "c", [rec(1, 6.0, 0, False), rec(2, 5.0, 0, False)], steps=2))
    assert s["skipped_updates"] == 0 and "updates skipped" not in _text(s)


def test_a_seed_run_names_its_seed_and_how_to_start_from_it(tmp_path, capsys):
    """#5: `train checkpoint.create_seed=true output_dir=runs/seed` wrote checkpoint/step-0 and printed only its
    header and data lines. Now it names the seed and the commands that start from it; the train command runs."""
    import shlex

    from conftest import train_here

    res = train_here(["train", "checkpoint.create_seed=true", "output_dir=runs/seed", "model.n_layers=3"],
                     tmp_path, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("seed checkpoint:"))
    assert line.startswith("seed checkpoint: runs/seed/checkpoint/step-0 (the initial weights)")
    assert "apiary compare KEY=A,B recipe=debug_moe model.n_layers=3 checkpoint.load_path=runs/seed/checkpoint/step-0" \
        in line
    cmd = line.split("Train from it: ", 1)[1].split(";", 1)[0]
    assert cmd == "train recipe=debug_moe model.n_layers=3 checkpoint.load_path=runs/seed/checkpoint/step-0 output_dir=RUN"
    argv = [a.replace("output_dir=RUN", "output_dir=runs/a") for a in shlex.split(cmd)]
    res = train_here([*argv, "training.steps=1", "logging.tensorboard=false"], tmp_path, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "runs" / "a" / "metrics.jsonl").is_file() and "seed checkpoint:" not in res.stdout


def test_a_kl_term_without_ref_logprobs_names_the_tool_that_adds_them(tmp_path):
    """#6: `train recipe=debug_grpo loss.kl_coef=1e-3` said "Add ref_logprobs to the rollouts" and named no way
    to. Now it names `apiary logprobs MODEL ROLLOUTS --out DIR` with the rollouts this run reads."""
    import pytest

    from framework.errors import UserError
    from framework.resolve.resolver import resolve

    with pytest.raises(UserError) as e:
        resolve("debug_grpo", ["loss.kl_coef=1e-3", f"output_dir={tmp_path / 'run'}"])
    text = str(e.value)
    assert "needs ref_logprobs in every rollout record" in text
    assert "apiary logprobs MODEL " in text and "tiny_rollouts.jsonl --out DIR (docs/skills/logprobs.md)" in text
    assert "data.path=DIR" in text and "loss.kl_coef=0" in text
