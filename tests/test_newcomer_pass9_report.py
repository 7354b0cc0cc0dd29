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
