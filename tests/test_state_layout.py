"""A state backend runs the degrees it declares (``State.layout``), applied by resolve right after
the layout is derived: layout.json, the printed dims, the planner and the trainer agree. ZeRO-1 has
no replicate/shard split, so dp_replicate folds into dp_shard there and nowhere later."""

from __future__ import annotations

import pytest

from framework.resolve.resolver import resolve
from framework.train.build import trainer_config

BASE = ["launcher.nproc=4", "parallel.dp_replicate=2", "parallel.ep=1", "checkpoint.enable=false"]


def _resolve(*over):
    return resolve("debug_moe", [*BASE, *over], world_size=4, for_training=False)  # not the process's env


def test_zero1_folds_dp_replicate_into_dp_shard_when_resolved():
    f = _resolve("state=fsdp2")
    z = _resolve("state=zero1")
    assert (f.layout.dp_replicate, f.layout.dp_shard) == (2, 2)
    assert (z.layout.dp_replicate, z.layout.dp_shard) == (1, 4)
    assert "state=zero1" in z.layout.rules["dp_shard"] and "state=zero1" in z.layout.rules["dp_replicate"]
    assert z.layout.dp == f.layout.dp == 4 and z.layout.world_size == 4
    assert (z.cfg.parallel.dp_replicate, z.cfg.parallel.dp_shard) == (1, 4)  # what layout.json and workers read
    assert z.grad_accum == f.grad_accum


def test_the_trainer_runs_the_resolved_degrees(tmp_path):
    tc = trainer_config(_resolve("state=zero1", f"output_dir={tmp_path / 'z'}"))
    assert (tc.parallelism.data_parallel_replicate_degree, tc.parallelism.data_parallel_shard_degree) == (1, 4)
    tc = trainer_config(_resolve("state=fsdp2", f"output_dir={tmp_path / 'f'}"))
    assert (tc.parallelism.data_parallel_replicate_degree, tc.parallelism.data_parallel_shard_degree) == (2, 2)


def test_zero1_apply_refuses_a_layout_not_resolved_for_it(tmp_path):
    from components.state.zero1 import Zero1

    r = _resolve("state=fsdp2", f"output_dir={tmp_path}")  # dp_replicate 2 kept
    tc = trainer_config(r)
    with pytest.raises(ValueError, match="runs no replicated data parallel, got dp_replicate=2"):
        Zero1.apply(Zero1.Options(), tc, r.ctx)
