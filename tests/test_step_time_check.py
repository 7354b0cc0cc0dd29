"""The planner's step time against the measured steps (benchmarks/step_time_check.py), on CPU: every
held point within 20%, the table's numbers those of its source files, recompute ranked at 128K as
measured, and attention counted over the data's documents."""

import importlib.util
import sys
from pathlib import Path

import pytest

from components.data.local_text import PACKAGED_CORPUS, document_tokens
from framework.plan import planner
from framework.resolve.resolver import resolve

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("step_time_check", ROOT / "benchmarks" / "step_time_check.py")
stc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("step_time_check", stc)  # its dataclasses look their module up
_spec.loader.exec_module(stc)


@pytest.fixture(scope="module")
def rows():
    return {r["point"]: r for r in stc.check()}


def test_every_held_point_is_planned_within_the_limit(rows):
    held = [r for r in rows.values() if r["held"]]
    assert len(held) >= 20 and any(r["gpus"] == 2 for r in held)
    off = [f"{r['point']}: {r['planned_s']:.3f} s planned, {r['measured_s']:.3f} measured ({r['error']:+.1%})"
           + ("" if r["same_choice"] else f", auto chose {r['chosen']}") for r in held if not r["ok"]]
    assert not off, "\n".join(off)


def test_the_check_exits_non_zero_on_a_point_off_by_more_than_the_limit(monkeypatch, capsys):
    from dataclasses import replace

    good = stc.POINTS[3]  # 32K full, one H200
    monkeypatch.setattr(stc, "POINTS", [good])
    assert stc.main([]) == 0
    monkeypatch.setattr(stc, "POINTS", [good, replace(good, name="slow", measured_s=good.measured_s * 1.3)])
    assert stc.main([]) == 1
    assert "OFF: slow" in capsys.readouterr().out
    monkeypatch.setattr(stc, "POINTS", [replace(good, measured_s=good.measured_s * 1.3, held=False)])
    assert stc.main([]) == 0


def test_the_table_holds_its_sources_numbers():
    """Each point read back from its docs/bench_data file (a table's s/step, metrics.jsonl's median step)."""
    read = 0
    for p in stc.POINTS:
        got = stc.recorded(p)
        if p.source.startswith(stc.DATA):
            assert got is not None, p.name
            assert got == pytest.approx(p.measured_s, abs=0.0015), p.name
            read += 1
    assert read >= 20


def test_recompute_is_ranked_as_measured_at_128k(rows):
    """One H200, 4 layers, 128K (2026-11-29): auto (the attention block kept) < selective < full, measured and
    planned."""
    names = ("128K auto", "128K selective", "128K full")
    measured = [rows[n]["measured_s"] for n in names]
    planned = [rows[n]["planned_s"] for n in names]
    assert measured == sorted(measured)
    assert planned == sorted(planned), dict(zip(names, planned))


def test_attention_is_counted_over_the_datas_documents():
    """The packaged corpus's documents (sum L^2 / sum L, the byte tokenizer's tokens) bound what a packed
    row attends: the attention time is the whole-row causal square's x documents / seq; a hub dataset
    (not read) keeps the square, and the model FLOPs a run logs keep it either way."""
    n = document_tokens(str(PACKAGED_CORPUS))
    assert 500 < n < 5000
    base = ["model.n_layers=4", "parallel.cp=1", "parallel.ep=1", "parallel.dp_shard=1", "training.local_batch=1",
            "training.seq_len=131072", "recompute=full", "data.tokenizer=byte"]
    packed = planner.plan(resolve("qwen35_35b_128k", base + ["data.name=packaged"], world_size=1, for_training=False),
                          gpu="H200")
    hub = planner.plan(resolve("qwen35_35b_128k", base + ["data.name=some/hub_dataset"], world_size=1,
                               for_training=False), gpu="H200")
    assert packed.time_s["compute_attention"] == pytest.approx(hub.time_s["compute_attention"] * n / 131072)
    assert packed.time_s["compute_dense"] == hub.time_s["compute_dense"]
    assert packed.flops_per_token == hub.flops_per_token
    assert packed.memory_bytes == hub.memory_bytes


def test_document_tokens_of_a_local_source(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "ab"}\n{"text": "abcdef"}\n\n')
    assert document_tokens(str(f)) == pytest.approx((4 * 4 + 8 * 8) / (4 + 8))  # + BOS and EOS each
    assert document_tokens(str(tmp_path / "missing.jsonl")) is None
