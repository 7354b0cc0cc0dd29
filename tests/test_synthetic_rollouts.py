"""benchmarks/synthetic_rollouts.py: rollouts of a chosen length for the planner and speed benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from components.data.rollouts import RolloutIndex, pack_rows

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "synthetic_rollouts.py"


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


def test_records_have_the_asked_length_and_pass_the_loaders_checks(tmp_path):
    out = tmp_path / "r.jsonl"
    proc = _run(tmp_path, "--count", "10", "--tokens", "4096", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    idx = RolloutIndex(out, validate=True)  # the pre-launch check a run applies
    assert idx.lengths == [4096] * 10 and all(idx.trained)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    groups = {}
    for r in recs:
        groups.setdefault(r["group_id"], []).append(r)
        n_prompt = r["loss_mask"].index(1)
        assert n_prompt == 257 and r["input_ids"][0] == 256 and r["input_ids"][-1] == 257
    assert [len(g) for g in groups.values()] == [4, 4, 2]  # the last group holds the remainder
    for g in groups.values():  # group-normalised: rewarded and unrewarded responses balance
        assert abs(sum(r["advantages"] for r in g)) < 1e-5 and len({r["advantages"] for r in g}) == 2
        assert all(r["input_ids"][:257] == g[0]["input_ids"][:257] for r in g)  # one prompt per group
    # eight 4,096-token rollouts fill a 32K row exactly, as the benchmark's long-rollout row intends
    rows, width = pack_rows([4096] * 16, 32768)
    assert [len(r) for r in rows] == [8, 8] and width == 32768
    again = tmp_path / "again.jsonl"
    assert _run(tmp_path, "--count", "10", "--tokens", "4096", "--out", str(again)).returncode == 0
    assert again.read_bytes() == out.read_bytes()  # seeded


def test_impossible_lengths_are_a_usage_error(tmp_path):
    proc = _run(tmp_path, "--tokens", "100", "--prompt", "256", "--out", str(tmp_path / "x.jsonl"))
    assert proc.returncode == 2 and "tokens >= prompt + 2" in proc.stderr
    assert not (tmp_path / "x.jsonl").exists()
