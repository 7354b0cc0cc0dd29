"""Newcomer pass 9 (report): what a user reads after a run is right about it."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from framework.compose import registry
from framework.report import summary

# Ground truth, independent of the components' declarations: the losses whose number is a policy
# objective (no likelihood to minimise; the summary reports the reward, not a best loss).
POLICY = {"grpo", "dapo", "gspo", "cispo", "ppo"}
LIKELIHOOD = {"ce", "chunked", "linear_ce", "ce_zloss", "sft"}


def _loss_names() -> list[str]:
    return sorted(registry.names("loss"))


def test_every_registered_loss_is_classified_here():
    assert set(_loss_names()) == POLICY | LIKELIHOOD, "classify the new loss in POLICY or LIKELIHOOD"


@pytest.mark.parametrize("name", _loss_names())
@pytest.mark.parametrize("fmt", ["text", "rollouts"])
def test_summary_classification_matches_policy_objective(name, fmt):
    cfg = OmegaConf.create({"loss": {"name": name}, "data": {"format": fmt}})
    assert summary._rl_objective(cfg, []) is (name in POLICY)


def test_ce_zloss_on_text_summary_names_its_best_loss(tmp_path):
    """was: `train loss=ce_zloss ...` read 'loss first .. last .. (a policy objective: see the reward)'."""
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(
        {"recipe": "debug_moe", "training": {"steps": 2}, "loss": {"name": "ce_zloss", "z_loss": 0.5},
         "data": {"format": "text"}})))
    recs = [{"step": 1, "loss": 22.4733}, {"step": 2, "loss": 22.0586}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = summary.summarize(tmp_path)
    assert s["rl_objective"] is False
    text = dict(summary.lines(s))["loss"]
    assert "best 22.0586" in text and "policy objective" not in text


def test_follow_timeout_says_how_many_records_were_dropped_as_stale(tmp_path, capsys):
    """was: with rl.max_lag=0 the exit-77 paragraph said only 'no rollouts for step 2 ... (data.wait_timeout=3)';
    the 16 records read and dropped as stale appeared only in the ledger."""
    from tests.conftest import train_here

    fdir = tmp_path / "fdir"
    fdir.mkdir()
    for idx in (1, 2):  # 16 records of 16 tokens each: one shard fills a 4-row step of 64 tokens
        recs = [{"input_ids": [1 + i % 7] * 16, "loss_mask": [0] + [1] * 15, "old_logprobs": [-1.0] * 16,
                 "advantages": 0.5, "sequence_id": f"s{idx}_{i}", "policy_version": 0} for i in range(16)]
        (fdir / f"{idx:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = train_here(["train", "recipe=debug_grpo_live", "data.path=fdir", "publish.dir=fw", "output_dir=runs/fol",
                      "rl.max_lag=0", "data.wait_timeout=3", "training.steps=3", "training.seq_len=64",
                      "logging.tensorboard=false"], tmp_path, capsys)
    assert res.returncode == 77, res.stderr[-2000:]
    said = "16 record(s) dropped as stale: their policy_version 0 is more than rl.max_lag=0 versions behind"
    paragraph = next(line for line in res.stderr.splitlines() if "Exit code 77" in line)
    assert said in paragraph and "raise rl.max_lag" in paragraph, paragraph
    stop = json.loads((tmp_path / "runs/fol/summary.json").read_text())["stop"]
    assert said in stop and "raise rl.max_lag" in stop, stop


def _rollouts(tmp_path):
    src = tmp_path / "ro.jsonl"
    src.write_text(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}) + "\n")
    return src


def test_logprobs_refuses_an_out_folder_that_is_not_empty(tmp_path, capsys):
    """was: a second `apiary logprobs MODEL ro.jsonl --out sc10` silently replaced the first's scores."""
    from toolkit.cli import apiary_main

    src, out = _rollouts(tmp_path), tmp_path / "sc10"
    out.mkdir()
    (out / "ro.jsonl").write_text("first run's scores\n")
    code = apiary_main(["logprobs", str(tmp_path / "model"), str(src), "--out", str(out)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and f"--out {out}: is not an empty folder" in err and "Choose a new folder" in err, err
    assert (out / "ro.jsonl").read_text() == "first run's scores\n" and sorted(out.iterdir()) == [out / "ro.jsonl"]


@pytest.mark.parametrize("temperature", ["inf", "1e-30", "nan", "0", "-1", "1000"])
def test_logprobs_refuses_a_temperature_outside_its_range(tmp_path, capsys, temperature):
    """was: inf and 1e-30 were accepted (1e-30 wrote ref_logprobs like -3.57e+29)."""
    from toolkit.cli import apiary_main

    code = apiary_main(["logprobs", str(tmp_path / "model"), str(_rollouts(tmp_path)), "--out", str(tmp_path / "o"),
                        "--temperature", temperature])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "--temperature" in err and "must be a number from 0.001 to 100" in err, err
    assert not (tmp_path / "o").exists()
