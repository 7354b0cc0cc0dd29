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
