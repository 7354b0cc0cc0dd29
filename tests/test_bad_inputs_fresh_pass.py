"""The fresh pass of bad inputs (docs/bad_inputs_third_pass.md, benchmarks/bad_inputs_third_pass.py):
the policy objectives' numbers, the mismatch threshold and the engine's wait are refused before launch
when they are not finite or out of range (they were accepted, NaN passing every comparison)."""

from __future__ import annotations

import pytest

from framework.errors import UserError
from framework.resolve import resolve


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
